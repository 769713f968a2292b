"""``schedule.vocab_parallel`` over gloo: the word embedding, output layer and loss run on every
pipeline rank (the output layer and loss on a sequence part of every slice,
``runtime/pipeline/vocab.py``; the lookups of each rank's vocabulary shard, ``vocab_embedding.py``,
untied replicas holding only that shard), and the loss and every
parameter gradient still equal the single-process, unpipelined, unsliced reference within fp32
round-off (|a - b| <= 2e-5 + 1e-4 |b|), untied and tied embeddings, one model chunk per rank and
two (interleaved)."""

import pytest
import torch

from megatron_slim.plan.cost.slicing import uniform_slices
from megatron_slim.runtime.spawn import run_ranks
from tests.oracle.models import TINY_GQA_4L
from tests.runtime.pipeline import _vocab_workers

SEQ = TINY_GQA_4L["seq_length"]
TOL = dict(atol=2e-5, rtol=1e-4)
CONFIGS = {
    2: [
        (False, "slimpipe", 2, uniform_slices(SEQ, 2)),
        (True, "slimpipe", 2, uniform_slices(SEQ, 2)),
        (False, "1f1b", 3, (SEQ,)),
        (True, "1f1b", 3, (SEQ,)),
        (False, "slimpipe", 3, (8, 24)),  # uneven slices: parts of 4/4 and 12/12 tokens
    ],
    4: [
        (False, "slimpipe", 3, uniform_slices(SEQ, 4)),
        (True, "slimpipe", 2, (12, 20)),
        (False, "1f1b", 5, (SEQ,)),  # 5 microbatches: backwards of stage 0 between its forwards
        (True, "1f1b", 4, (SEQ,)),
    ],
}


# two model chunks per rank: the embedding on rank 0's first chunk, the output layer after rank 1's
# second (the exchanges placed by plan/schedule/vocab_cuts.py)
INTERLEAVED = [(True, "slimpipe", 3, (12, 20), 2), (False, "interleaved", 4, (SEQ,), 2)]


def _check(results, configs):
    for index, (_, _, (ref_reports, ref_grads), _) in enumerate(results[0]):
        merged: dict = {}
        for rank_results in results:
            _, grads, _, _ = rank_results[index]
            for name, g in grads.items():
                assert g is not None, name
                if name in merged:  # a tied embedding's copies: each holds the whole gradient
                    torch.testing.assert_close(g, merged[name], **TOL, msg=lambda m: f"{name} copies: {m}")
                merged[name] = g
        reports = results[-1][index][0]
        assert len(reports) == len(ref_reports)
        for got, want in zip(reports, ref_reports):
            torch.testing.assert_close(got, want, **TOL)
        assert merged.keys() == ref_grads.keys()
        for name, want in ref_grads.items():
            torch.testing.assert_close(merged[name], want, **TOL, msg=lambda m: f"{name}: {m}")
        assert all(results[r][index][0] == [] for r in range(len(results) - 1))  # reports: last stage only
        _check_shards(configs[index][0], [rank_results[index][3] for rank_results in results])


def _check_shards(tied, heads):
    """Each rank's output-weight copy: the last stage's whole; untied, every replica only its
    vocabulary shard's rows (as ``torch.tensor_split`` cuts the vocabulary). Its word-embedding copy
    (tied: the same): stage 0's whole; untied, every other rank's only its shard's rows."""
    vocab = heads[-1][1][0]
    assert heads[-1][0] and heads[0][2]
    shards = [len(rows) for rows in torch.tensor_split(torch.arange(vocab), len(heads))]
    for (owned, shape, lookup_owned, lookup_shape), rows in zip(heads, shards):
        assert shape[0] == (vocab if owned or tied else rows)
        assert lookup_shape[0] == (vocab if lookup_owned or tied else rows)


# slow tier for pp4: pp2 and the interleaved pp2 x vpp2 case run the exchange by default, and the
# context-exchange and SlimPipe exactness tests run pp4's middle stages
@pytest.mark.parametrize(
    "pp",
    [pytest.param(pp, marks=[pytest.mark.slow] if pp > 2 else []) for pp in sorted(CONFIGS)],
    ids=lambda pp: f"pp{pp}",
)
def test_vocab_parallel_matches_unpipelined_unsliced_reference(pp):
    _check(run_ranks(_vocab_workers.run_vocab_parallel, pp, CONFIGS[pp], timeout_s=900), CONFIGS[pp])


def test_vocab_parallel_interleaved_matches_unpipelined_unsliced_reference():
    _check(run_ranks(_vocab_workers.run_vocab_parallel, 2, INTERLEAVED, timeout_s=900), INTERLEAVED)
