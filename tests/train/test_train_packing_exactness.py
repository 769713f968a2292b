"""One packed training step (``data.packing``, pp=2 and pp2 x cp2, SlimPipe slices cutting through
documents) equals the single-process reference that runs every sample on its own (a document mask),
in the loss and in every parameter gradient.

The packed step is the training job's own: ``PackedData`` windows, ``packed_forward_step`` with its
global per-token loss weights (under CP ``packed_cp_forward_step``: each slice split zigzag-wise over
the CP ranks, SlimPipe's query-out CP slice attention), the recipe's SlimPipe schedule, the loop's
gradient average over data x context parallel ranks; slice attention keeps to each document of a
window (``document_lengths``) and RoPE positions restart per document."""

import pytest
import torch

from megatron_slim.runtime.spawn import run_ranks
from tests.oracle import reference
from tests.oracle.models import TINY_GQA_2L_LONG

pytestmark = pytest.mark.multi
TOL = dict(atol=2e-5, rtol=1e-4)
SEQ = 128
MODEL = dict(TINY_GQA_2L_LONG, seq_length=SEQ)
LENGTHS = (7, 45, 130, 20, 56, 100, 9, 13, 6, 300, 33, 64)


def _recipe(method: str, cp: int = 1, tp: int = 1):
    from megatron_slim.plan.recipe import recipe_from_dict

    return recipe_from_dict(
        {
            "name": "packed-step",
            "model": MODEL,
            "parallel": {"pp": 2, "cp": cp, "tp": tp},
            "schedule": {"kind": "slimpipe", "num_slices": 4},
            "train": {"global_batch_size": 8, "precision": "fp32"},
            "data": {"packing": method},
        }
    )


def _documents(seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, MODEL["vocab_size"], (n,), generator=g).numpy() for n in LENGTHS]


def _one_pack(batches) -> dict:
    """Every window back to back as one pack whose documents are the windows' ``document_lengths``."""
    return {
        "tokens": torch.cat([b["tokens"][0] for b in batches]),
        "labels": torch.cat([b["labels"][0] for b in batches]),
        "loss_mask": torch.cat([b["loss_mask"][0] for b in batches]),
        "lengths": [n for b in batches for n in b["document_lengths"]],
    }


def _crosses_slices(batches, slice_length: int) -> bool:
    """Whether some document of some window spans a slice boundary."""
    for b in batches:
        start = 0
        for n in b["document_lengths"]:
            if n and start // slice_length != (start + n - 1) // slice_length:
                return True
            start += n
    return False


def reference_step(rank, world_size, method, tp, seed=1234):
    """The per-document reference in a world of its own: under tensor parallelism megatron's
    vocab-parallel loss reads the global TP group, which a reference beside the TP ranks would join."""
    from megatron_slim.megatron.model.parallel import init_model_parallel
    from megatron_slim.train.packed import PackedData

    groups, recipe = init_model_parallel(seed=seed), _recipe(method, 1, tp)
    pack = _one_pack(PackedData(recipe, _documents(seed), dp=1).step(0, 0)[1])
    return pack["tokens"], reference.per_document_step(recipe.model, groups, [pack], seed)


def packed_step(rank, world_size, method, tp=1, ref=None, seed=1234):
    import functools

    import torch.distributed as dist

    from megatron_slim.megatron.model.gpt import build_rank_chunks, global_grads, global_named_parameters
    from megatron_slim.megatron.model.parallel import init_model_parallel
    from megatron_slim.megatron.model.weights import tp_shard
    from megatron_slim.megatron.slimpipe.schedule import make_forward_backward_func
    from megatron_slim.megatron.slimpipe.slicing import SliceCoreAttention
    from megatron_slim.runtime.pipeline.slice_context import SliceContext
    from megatron_slim.train.loop import pipeline_settings
    from megatron_slim.train.packed import PackedData, packed_cp_forward_step, packed_forward_step
    from megatron_slim.train.step import average_data_parallel

    cp = world_size // (2 * tp)
    recipe = _recipe(method, cp, tp)
    groups = init_model_parallel(tp=tp, pp=2, cp=cp, seed=seed)
    solo = reference.solo_groups(rank, world_size)
    data = PackedData(recipe, _documents(seed), dp=1)
    packing, batches = data.step(0, 0)
    chunks = build_rank_chunks(recipe.model, groups, core_attention=SliceCoreAttention, seed=seed)
    context = SliceContext(documents_on_every_tp_rank=True)  # as the training loop: every rank reads its batch
    fb = make_forward_backward_func(pipeline_settings(recipe, measure_memory=False), context)
    reports = fb(
        forward_step_func=functools.partial(packed_cp_forward_step, groups.cp) if cp > 1 else packed_forward_step,
        data_iterator=[iter(batches)],
        model=chunks,
        num_microbatches=len(batches),
        seq_length=SEQ,
        micro_batch_size=1,
    )
    average_data_parallel(list(chunks[0].parameters()), groups.dp_cp, cp)  # the loop's dp x cp average
    pair = torch.stack([r["lm loss"] for r in reports]).sum(0) if reports else torch.zeros(2)
    dist.all_reduce(pair)  # only the last stage reports; under CP each rank its own tokens
    pack = _one_pack(batches)
    if ref is None:
        ref_loss, ref_grads = reference.per_document_step(recipe.model, solo, [pack], seed)
    else:
        ref_tokens, (ref_loss, ref_grads) = ref
        assert torch.equal(ref_tokens, pack["tokens"])  # the reference ran the same pack
    params = global_named_parameters(chunks[0])
    ref_grads = {n: tp_shard(g, params[n], groups.tp_rank, tp) if n in params else g for n, g in ref_grads.items()}
    return {
        "pair": pair,
        "grads": global_grads(chunks[0]),
        "ref_loss": ref_loss,
        "ref_grads": ref_grads,
        "crosses": _crosses_slices(batches, SEQ // recipe.schedule.num_slices),
        "windows": len(batches),
    }


# Megatron packing at pp2xcp2 and tp2xpp2, and SlimPack at tp2xpp2, run in the slow tier: SlimPack's
# windows cover the CP path in the default tier, Megatron packing's windows the pp2 one, and packed
# windows under tp2 run in the contract tier (tests/real_megatron/test_packing_tp_cp_launch.py).
@pytest.mark.parametrize(
    "method, world_size, tp",
    [
        pytest.param(method, world, tp, id=f"{method}-{layout}", marks=[pytest.mark.slow] if slow else [])
        for method in ("slimpack", "megatron")
        for world, tp, layout in ((2, 1, "pp2"), (4, 1, "pp2xcp2"), (4, 2, "tp2xpp2"))
        for slow in [(method == "megatron" and world == 4) or tp == 2]
    ],
)
def test_packed_step_equals_the_per_document_reference(method, world_size, tp):
    ref = run_ranks(reference_step, 1, method, tp)[0] if tp > 1 else None
    results = run_ranks(packed_step, world_size, method, tp, ref, timeout_s=300)
    assert results[0]["crosses"] and results[0]["windows"] > 1
    stages = set()
    for got in results:
        torch.testing.assert_close(got["pair"][0] / got["pair"][1], got["ref_loss"], **TOL)
        assert got["grads"]
        stages.add(frozenset(got["grads"]))
        for name, grad in got["grads"].items():
            torch.testing.assert_close(grad, got["ref_grads"][name], **TOL, msg=lambda m, n=name: f"{n}: {m}")
    assert set().union(*stages) == set(results[0]["ref_grads"])  # every gradient, over both stages
