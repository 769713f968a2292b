"""Rank function for the recompute and offload tests under SlimPipe (module level so spawn can
import it): one training call per case on the same weights and batches."""

import dataclasses

from megatron_slim.plan.recipe import ModelConfig
from tests.oracle.models import TINY_GQA_8L
from tests.runtime.pipeline._workers import _call, make_batches


def run_cases(rank, world_size, cases, lengths, num_microbatches, seed=1234):
    """Each case: (name, TransformerConfig overrides, offload ratio). Returns per case name
    (loss reports, every local parameter gradient, peak activation bytes, offloaded bytes)."""
    from megatron_slim.megatron.model.gpt import build_rank_chunks, global_grads
    from megatron_slim.megatron.model.parallel import init_model_parallel
    from megatron_slim.megatron.slimpipe.schedule import SlimPipeSettings, make_forward_backward_func
    from megatron_slim.megatron.slimpipe.slicing import SliceCoreAttention

    groups = init_model_parallel(pp=world_size)
    model = ModelConfig(**TINY_GQA_8L)
    batches = make_batches(model, num_microbatches, micro_batch=2, seed=seed)
    out = {}
    for name, overrides, ratio in cases:
        chunks = build_rank_chunks(
            model, dataclasses.replace(groups, vpp=1), core_attention=SliceCoreAttention, seed=seed, **overrides
        )
        settings = SlimPipeSettings(tuple(lengths), measure_memory=True, offload_ratio=ratio)
        fb = make_forward_backward_func(settings)
        reports = _call(fb, chunks, batches, model)
        grads = {}
        for c in chunks:
            grads.update(global_grads(c))
        stats = fb.stats
        out[name] = ([r["lm loss"] for r in reports], grads, stats.peak_activation_bytes, stats.offloaded_bytes)
    return out


def run_cp_cases(rank, world_size, cp, cases, lengths, num_microbatches, exchange=False, seed=1234):
    """SlimPipe's zigzag query-out CP over ``world_size // cp`` stages x ``cp`` CP ranks (vpp 1), one
    training call per case (name, TransformerConfig overrides, offload ratio) on the same weights and
    batches ("cp" loss). Returns per case name (loss reports summed over CP, CP-averaged gradients,
    tp rank 0, the single-process reference on rank 0 else None, peak activation bytes, offloaded
    bytes, K/V rows this rank shipped to exchange peers)."""
    from megatron_slim.megatron.model.gpt import build_rank_chunks
    from megatron_slim.megatron.model.parallel import init_model_parallel, teardown
    from megatron_slim.megatron.slimpipe.schedule import SlimPipeSettings, make_forward_backward_func
    from megatron_slim.megatron.slimpipe.slicing import SliceCoreAttention
    from tests.oracle import reference
    from tests.runtime.pipeline._cp_workers import _batches, cp_step

    model = ModelConfig(**TINY_GQA_8L)
    batches = _batches(model, num_microbatches, "cp", seed)
    solo = init_model_parallel()
    ref = reference.unsliced_step(model, solo, batches, seed) if rank == 0 else None
    teardown()
    groups = init_model_parallel(pp=world_size // cp, cp=cp)
    out = {}
    for name, overrides, ratio in cases:
        chunks = build_rank_chunks(model, groups, core_attention=SliceCoreAttention, seed=seed, **overrides)
        settings = SlimPipeSettings(tuple(lengths), measure_memory=True, offload_ratio=ratio, exchange=exchange)
        fb = make_forward_backward_func(settings)
        reports, grads = cp_step(fb, chunks, batches, num_microbatches, model.seq_length, "cp", groups.cp)
        stats = fb.stats
        out[name] = (
            reports,
            grads,
            0,
            ref,
            stats.peak_activation_bytes,
            stats.offloaded_bytes,
            stats.exchanged_tokens,
        )
    teardown()
    return out
