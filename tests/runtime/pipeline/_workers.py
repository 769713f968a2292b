"""Rank functions for the SlimPipe multi-process tests (module level so spawn can import them)."""

import dataclasses

import torch

from megatron_slim.plan.recipe import ModelConfig
from megatron_slim.train.microbatch import forward_step  # the training job's own
from tests.oracle import reference
from tests.oracle.models import TINY_GQA_8L


def make_batches(model: ModelConfig, num_microbatches: int, micro_batch: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num_microbatches):
        tokens = torch.randint(0, model.vocab_size, (micro_batch, model.seq_length + 1), generator=g)
        mask = (torch.rand(micro_batch, model.seq_length, generator=g) > 0.15).float()
        pos = torch.arange(model.seq_length).expand(micro_batch, -1).contiguous()
        out.append(
            {
                "tokens": tokens[:, :-1].contiguous(),
                "labels": tokens[:, 1:].contiguous(),
                "loss_mask": mask,
                "position_ids": pos,
            }
        )
    return out


def run_slimpipe(rank, world_size, configs, seed=1234):
    """Each config: (vpp, num_microbatches, slice_lengths). Returns per config (reports, grads, ref)."""
    from megatron_slim.megatron.model.gpt import build_rank_chunks, global_grads
    from megatron_slim.megatron.model.parallel import init_model_parallel
    from megatron_slim.megatron.slimpipe.schedule import SlimPipeSettings, make_forward_backward_func
    from megatron_slim.megatron.slimpipe.slicing import SliceCoreAttention

    groups = init_model_parallel(pp=world_size)
    model = ModelConfig(**TINY_GQA_8L)
    results = []
    for vpp, m, lengths in configs:
        batches = make_batches(model, m, micro_batch=2, seed=seed + m)
        chunks = build_rank_chunks(
            model, dataclasses.replace(groups, vpp=vpp), core_attention=SliceCoreAttention, seed=seed
        )
        fb = make_forward_backward_func(SlimPipeSettings(tuple(lengths), measure_memory=True))
        reports = _call(fb, chunks, batches, model)
        grads = {}
        for c in chunks:
            grads.update(global_grads(c))
        ref = reference.unsliced_step(model, groups, batches, seed) if rank == 0 else None
        results.append(
            ([r["lm loss"] for r in reports], grads, ref, (fb.stats.peak_activation_bytes, fb.stats.peak_kv_bytes))
        )
    return results


def _call(fb, chunks, batches, model: ModelConfig, forward_only: bool = False):
    """One schedule call over ``batches`` (micro batch 2), each chunk reading its own iterator."""
    return fb(
        forward_step_func=forward_step,
        data_iterator=[iter(batches) for _ in chunks],
        model=chunks,
        num_microbatches=len(batches),
        seq_length=model.seq_length,
        micro_batch_size=2,
        forward_only=forward_only,
    )


def run_forward_only(rank, world_size, configs, seed=1234):
    """Each config: (vpp, num_microbatches, slice_lengths). Returns per config the losses of a
    forward-only call and of a training call on the same batches, and how many parameters had a
    gradient after each."""
    from megatron_slim.megatron.model.gpt import build_rank_chunks
    from megatron_slim.megatron.model.parallel import init_model_parallel
    from megatron_slim.megatron.slimpipe.schedule import SlimPipeSettings, make_forward_backward_func
    from megatron_slim.megatron.slimpipe.slicing import SliceCoreAttention

    groups = init_model_parallel(pp=world_size)
    model = ModelConfig(**TINY_GQA_8L)
    results = []
    for vpp, m, lengths in configs:
        batches = make_batches(model, m, micro_batch=2, seed=seed + m)
        chunks = build_rank_chunks(
            model, dataclasses.replace(groups, vpp=vpp), core_attention=SliceCoreAttention, seed=seed
        )
        fb = make_forward_backward_func(SlimPipeSettings(tuple(lengths)))
        losses, with_grads = [], []
        for forward_only in (True, False):
            reports = _call(fb, chunks, batches, model, forward_only=forward_only)
            losses.append([r["lm loss"] for r in reports])
            with_grads.append(sum(p.grad is not None for c in chunks for p in c.parameters()))
        results.append((losses, with_grads))
    return results
