"""SlimPack's DP-merge in ``megatron-slim train`` (``data.packing: slimpack``, dp2, pp1 SlimPipe):
one packed step whose plan splits the outlier into a head on one DP replica and a tail on the other.

Each rank checks that the plan really split the sample over the replicas, that its windows hold the
plan's pieces, and that the K/V and dK/dV messages it planned went (two layers: K and V of the head
rows per layer one way, their dK and dV the other). Loss and every gradient equal the single-process
reference running each sample whole on its own."""

import pytest
import torch

from megatron_slim.runtime.spawn import run_ranks
from tests.oracle import reference
from tests.oracle.models import TINY_GQA_2L_LONG

pytestmark = pytest.mark.multi
TOL = dict(atol=2e-5, rtol=1e-4)
SEQ = 128
SLICES = 4
MODEL = dict(TINY_GQA_2L_LONG, seq_length=SEQ)
LENGTHS = (128, 7, 45, 20, 9, 13)


def _recipe(dp: int = 2):
    from megatron_slim.plan.recipe import recipe_from_dict

    return recipe_from_dict(
        {
            "name": "packed-dp-merge",
            "model": MODEL,
            "parallel": {"dp": dp},
            "schedule": {"kind": "slimpipe", "num_slices": SLICES},
            "train": {"global_batch_size": 2, "precision": "fp32"},
            "data": {"packing": "slimpack"},
        }
    )


def _documents(seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, MODEL["vocab_size"], (n,), generator=g).numpy() for n in LENGTHS]


def _sample_pack(data, samples) -> dict:
    """Every sample whole, back to back: labels the next token of its document, the document's last masked."""
    tokens, labels, mask, lengths = [], [], [], []
    for s in samples:
        doc = torch.as_tensor(data.documents[s.document])
        tokens.append(doc[s.offset : s.offset + s.length])
        following = doc[s.offset + 1 : s.offset + s.length + 1]
        labels.append(torch.cat([following, torch.zeros(s.length - len(following), dtype=doc.dtype)]))
        mask.append(torch.tensor([1.0] * len(following) + [0.0] * (s.length - len(following))))
        lengths.append(s.length)
    return {"tokens": torch.cat(tokens), "labels": torch.cat(labels), "loss_mask": torch.cat(mask), "lengths": lengths}


def merged_step(rank, world_size, seed=1234):
    import torch.distributed as dist

    from megatron_slim.megatron.model.gpt import build_rank_chunks, global_grads
    from megatron_slim.megatron.model.parallel import init_model_parallel
    from megatron_slim.megatron.slimpipe.schedule import make_forward_backward_func
    from megatron_slim.megatron.slimpipe.slicing import SliceCoreAttention
    from megatron_slim.runtime.pipeline.dp_merge import MergeLink
    from megatron_slim.runtime.pipeline.slice_context import SliceContext
    from megatron_slim.train.loop import pipeline_settings
    from megatron_slim.train.packed import PackedData, iteration_batches
    from megatron_slim.train.step import average_data_parallel

    recipe = _recipe()
    groups = init_model_parallel(pp=1, dp=2, seed=seed)
    solo = reference.solo_groups(rank, world_size)
    data = PackedData(recipe, _documents(seed), dp=2)
    settings = pipeline_settings(recipe, measure_memory=False)
    chunks = build_rank_chunks(recipe.model, groups, core_attention=SliceCoreAttention, seed=seed)
    context = SliceContext(documents_on_every_tp_rank=True)
    context.dp_merge = link = MergeLink(groups.dp, settings.slice_lengths)
    fb = make_forward_backward_func(settings, context)
    packing, batches, step = iteration_batches(data, recipe, 1, groups.dp_rank, None, None, link)
    reports = fb(
        forward_step_func=step,
        data_iterator=[iter(batches)],
        model=chunks,
        num_microbatches=len(batches),
        seq_length=SEQ,
        micro_batch_size=1,
    )
    link.finish()
    average_data_parallel(list(chunks[0].parameters()), groups.dp, 2)
    pair = torch.stack([r["lm loss"] for r in reports]).sum(0)
    dist.all_reduce(pair)
    ref_loss, ref_grads = reference.per_document_step(recipe.model, solo, [_sample_pack(data, packing.samples)], seed)
    return {
        "dp_merge": recipe.dp_merge and not _recipe(1).dp_merge,
        "merges": packing.merges,
        "pieces": [[p for w in ws for p in w.pieces] for ws in packing.windows],
        "window_pieces": [w.pieces for w in packing.windows[groups.dp_rank]],
        "plan_pieces": [tuple(sorted(m.pieces)) for m in packing.plan.ranks[groups.dp_rank]],
        "messages": link.messages,
        "slice_lengths": settings.slice_lengths,
        "pair": pair,
        "grads": global_grads(chunks[0]),
        "ref_loss": ref_loss,
        "ref_grads": ref_grads,
    }


def test_dp_merged_outlier_runs_over_two_replicas_and_matches_the_reference():
    results = run_ranks(merged_step, 2, timeout_s=300)
    merges = results[0]["merges"]
    assert results[0]["dp_merge"] and len(merges) == 1
    (t,) = merges
    assert {t.head.rank, t.tail.rank} == {0, 1} and t.prefix + t.tail.length == max(LENGTHS)
    pieces = results[0]["pieces"]
    assert [p.sample for p in pieces[t.head.rank]].count(t.sample) == 1
    assert [p.sample for p in pieces[t.tail.rank]].count(t.sample) == 1  # split: one piece on each replica
    layers = MODEL["num_layers"]
    for got in results:
        assert got["merges"] == merges
        assert [tuple(sorted(w)) for w in got["window_pieces"]] == got["plan_pieces"]
        assert got["messages"] == 4 * layers  # per layer: K, V one way and dK, dV the other
        torch.testing.assert_close(got["pair"][0] / got["pair"][1], got["ref_loss"], **TOL)
        assert set(got["grads"]) == set(got["ref_grads"])
        for name, grad in got["grads"].items():
            torch.testing.assert_close(grad, got["ref_grads"][name], **TOL, msg=lambda m, n=name: f"{n}: {m}")
