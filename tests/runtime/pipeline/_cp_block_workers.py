"""Rank function for the context-exchange block-plan test under query-out CP (module level so spawn
can import it)."""

import dataclasses

from megatron_slim.plan.recipe import ModelConfig
from tests.oracle import reference
from tests.oracle.models import TINY_GQA_8L
from tests.runtime.pipeline._cp_workers import _batches, cp_step


def run_blocks_cp(rank, world_size, cp, configs, seed=1234):
    """Each config: (num_microbatches, slice_lengths, the block plan's text) on the lowered slimpipe
    schedule (vpp 1) over ``world_size // cp`` stages x ``cp`` CP ranks. Returns per config (reports
    summed over CP, DDP-averaged grads, tp rank 0, reference on rank 0 else None, K/V rows this rank
    sent, attention blocks it served)."""
    from megatron_slim.megatron.model.gpt import build_rank_chunks
    from megatron_slim.megatron.model.parallel import init_model_parallel, teardown
    from megatron_slim.megatron.slimpipe import schedule as slimpipe_schedule
    from megatron_slim.megatron.slimpipe.schedule import SlimPipeSettings, make_forward_backward_func
    from megatron_slim.megatron.slimpipe.slicing import SliceCoreAttention
    from megatron_slim.plan.schedule.executable import executable

    model, pp = ModelConfig(**TINY_GQA_8L), world_size // cp
    solo = init_model_parallel()
    refs = [
        reference.unsliced_step(model, solo, _batches(model, m, "cp", seed), seed) if rank == 0 else None
        for m, _, _ in configs
    ]
    teardown()
    groups = init_model_parallel(pp=pp, cp=cp)
    results = []
    for (m, lengths, blocks), ref in zip(configs, refs):
        batches = _batches(model, m, "cp", seed)
        chunks = build_rank_chunks(model, groups, core_attention=SliceCoreAttention, seed=seed)
        planned = dataclasses.replace(executable("slimpipe", pp, 1, m, len(lengths)), exchange=blocks)
        slimpipe_schedule.planned_schedule = lambda *args, **kwargs: planned  # the hand-built plan
        fb = make_forward_backward_func(SlimPipeSettings(tuple(lengths), exchange=True))
        reports, grads = cp_step(fb, chunks, batches, m, model.seq_length, "cp", groups.cp)
        results.append((reports, grads, 0, ref, fb.stats.exchanged_tokens, fb.stats.served_blocks))
    teardown()
    return results
