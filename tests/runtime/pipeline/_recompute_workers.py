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
