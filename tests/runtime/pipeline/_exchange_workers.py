"""Rank function for the context-exchange exactness test (module level so spawn can import it)."""

import dataclasses

from megatron_slim.plan.recipe import ModelConfig, load_recipe
from tests.oracle import reference
from tests.oracle.models import TINY_GQA_8L
from tests.runtime.pipeline._workers import _call, make_batches


def run_exchange(rank, world_size, configs, seed=1234):
    """Each config: (vpp, num_microbatches, slice_lengths, timing recipe overrides of tiny-cpu or None for
    the unit-time pairing). Returns per config (loss reports, grads,
    reference on rank 0, K/V tokens this rank sent to exchange peers, the schedule's pairing text)."""
    from megatron_slim.megatron.model.gpt import build_rank_chunks, global_grads
    from megatron_slim.megatron.model.parallel import init_model_parallel
    from megatron_slim.megatron.slimpipe.call_plan import planned_schedule
    from megatron_slim.megatron.slimpipe.schedule import SlimPipeSettings, make_forward_backward_func
    from megatron_slim.megatron.slimpipe.slicing import SliceCoreAttention

    groups = init_model_parallel(pp=world_size)
    model = ModelConfig(**TINY_GQA_8L)
    results = []
    for vpp, m, lengths, timing in configs:
        batches = make_batches(model, m, micro_batch=2, seed=seed + m)
        chunks = build_rank_chunks(
            model, dataclasses.replace(groups, vpp=vpp), core_attention=SliceCoreAttention, seed=seed
        )
        recipe = None if timing is None else load_recipe("tiny-cpu", timing)
        settings = SlimPipeSettings(tuple(lengths), exchange=True, exchange_recipe=recipe)
        fb = make_forward_backward_func(settings)
        reports = _call(fb, chunks, batches, model)
        grads = {}
        for c in chunks:
            grads.update(global_grads(c))
        ref = reference.unsliced_step(model, groups, batches, seed) if rank == 0 else None
        pairing = planned_schedule(settings, world_size, vpp, m).exchange
        results.append(([r["lm loss"] for r in reports], grads, ref, fb.stats.exchanged_tokens, pairing))
    return results


def run_blocks(rank, world_size, configs, seed=1234):
    """Each config: (num_microbatches, slice_lengths, the block plan's text) on the lowered slimpipe
    schedule (vpp 1) in place of the planned pairing. Returns per config (loss reports, grads,
    reference on rank 0, K/V tokens this rank sent, attention blocks it served)."""
    from megatron_slim.megatron.model.gpt import build_rank_chunks, global_grads
    from megatron_slim.megatron.model.parallel import init_model_parallel
    from megatron_slim.megatron.slimpipe import schedule as slimpipe_schedule
    from megatron_slim.megatron.slimpipe.schedule import SlimPipeSettings, make_forward_backward_func
    from megatron_slim.megatron.slimpipe.slicing import SliceCoreAttention
    from megatron_slim.plan.schedule.executable import executable

    groups = init_model_parallel(pp=world_size)
    model = ModelConfig(**TINY_GQA_8L)
    results = []
    for m, lengths, blocks in configs:
        batches = make_batches(model, m, micro_batch=2, seed=seed + m)
        chunks = build_rank_chunks(model, groups, core_attention=SliceCoreAttention, seed=seed)
        planned = dataclasses.replace(executable("slimpipe", world_size, 1, m, len(lengths)), exchange=blocks)
        slimpipe_schedule.planned_schedule = lambda *args, **kwargs: planned  # the hand-built plan
        fb = make_forward_backward_func(SlimPipeSettings(tuple(lengths), exchange=True))
        reports = _call(fb, chunks, batches, model)
        grads = {}
        for c in chunks:
            grads.update(global_grads(c))
        ref = reference.unsliced_step(model, groups, batches, seed) if rank == 0 else None
        results.append(([r["lm loss"] for r in reports], grads, ref, fb.stats.exchanged_tokens, fb.stats.served_blocks))
    return results
