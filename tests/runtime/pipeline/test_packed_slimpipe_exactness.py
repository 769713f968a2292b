"""Packed windows through SlimPipe slices (megatron-core, RoPE, RMSNorm, SwiGLU, GQA, fp32): a slice
may hold the tail of one document and the head of the next; loss and every parameter gradient equal
an independent reference that runs every document on its own (positions from 0, plain causal
attention, megatron's per-microbatch normalisation: ``reference.per_document_step``).

The windows (32 tokens, slices of 8 unless said) hold a document spanning 3 slices, a slice holding
3+ documents, a document starting exactly on a slice boundary, one-token documents, and a padding
document with loss mask 0; the documents come as the key ``document_lengths``, Megatron's
block-causal mask, or its THD offsets ``cu_seqlens`` read by ``pretrain_gpt``'s ``PackedSeqParams`` forward
step (``_packed_workers.thd_forward_step``). Tolerance as in test_slimpipe_exactness (fp32 reordering only)."""

import pytest
import torch

from megatron_slim.runtime.spawn import run_ranks
from tests.runtime.pipeline import _packed_workers

TOL = dict(atol=2e-5, rtol=1e-4)
WINDOWS = [
    (3, 14, 2, 2, 5, 6),  # 3..16 spans slices 0-2; slice 2 holds 4 documents
    (8, 1, 20, 3),  # a document on a slice boundary, a one-token one, 9..28 spans slices 1-3
    (1, 1, 30),
]
EIGHTS = (8, 8, 8, 8)
UNEVEN = (5, 11, 7, 9)


def _check(results, num_configs):
    for i in range(num_configs):
        ref_loss, ref_grads = results[0][i][2]
        merged = {}
        for rank_results in results:
            merged.update(rank_results[i][1])
        torch.testing.assert_close(results[-1][i][0], ref_loss, **TOL)
        assert merged.keys() == ref_grads.keys()
        for name, want in ref_grads.items():
            assert merged[name] is not None, name
            torch.testing.assert_close(merged[name], want, **TOL, msg=lambda m: f"config {i} {name}: {m}")


def test_packed_slices_single_process_match_per_document_reference():
    configs = [
        (1, EIGHTS, WINDOWS, "sdpa", "key"),
        (1, UNEVEN, WINDOWS, "reference", "key"),
        (1, EIGHTS, WINDOWS[:2], "sdpa", "mask"),  # Megatron's block-causal mask instead of the key
        (1, UNEVEN, WINDOWS, "sdpa", "thd"),  # Megatron's THD offsets, through pretrain_gpt's PackedSeqParams step
    ]
    results = run_ranks(_packed_workers.run_packed, 1, configs, timeout_s=600)
    _check(results, len(configs))
    assert [r[3] for r in results[0]] == [{"sdpa"}, {"reference"}, {"sdpa"}, {"sdpa"}]


@pytest.mark.parametrize("vpp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_packed_slices_pp2_match_per_document_reference(vpp):
    configs = [
        (vpp, EIGHTS, WINDOWS, "sdpa", "key"),
        (vpp, UNEVEN, WINDOWS[1:], "reference", "key"),
        (vpp, EIGHTS, WINDOWS, "sdpa", "thd"),
    ]
    results = run_ranks(_packed_workers.run_packed, 2, configs, timeout_s=900)
    _check(results, len(configs))


@pytest.mark.slow  # default tier: tests/train/test_train_packing_exactness.py runs pp2 x cp2 through train
def test_packed_slices_pp2_cp2_match_per_document_reference():
    """Through the SlimPipe x CP path (query-out CP slice attention, megatron's zigzag split)."""
    configs = [(1, EIGHTS, WINDOWS, "sdpa"), (2, (4, 12, 8, 8), WINDOWS[1:], "reference")]
    results = run_ranks(_packed_workers.run_packed_cp, 4, configs, timeout_s=900)
    _check(results, len(configs))
