"""The SlimPipe step with context exchange that the train-path exchange tests share (tp and cp
variants): the training job's own pieces on one rank, after its groups and chunks are built."""

import functools

import torch
import torch.distributed as dist


def slimpipe_exchange_step(recipe, groups, chunks, batches, microbatches: int, seq: int):
    """Run one step; returns (the step's ``fb``, this rank's (loss sum, token count) summed over the
    CP group on the last stage, the pairing the step planned)."""
    from megatron_slim.megatron.slimpipe.call_plan import planned_schedule
    from megatron_slim.megatron.slimpipe.schedule import make_forward_backward_func
    from megatron_slim.runtime.pipeline.slice_context import SliceContext
    from megatron_slim.train.loop import pipeline_settings
    from megatron_slim.train.microbatch import forward_step
    from megatron_slim.train.packed import zigzag_cp_forward_step
    from megatron_slim.train.step import average_data_parallel, sum_tied_embedding_grads

    pp, cp = recipe.parallel.pp, recipe.parallel.cp
    settings = pipeline_settings(recipe)
    fb = make_forward_backward_func(settings, context=SliceContext(documents_on_every_tp_rank=True))
    reports = fb(
        forward_step_func=functools.partial(zigzag_cp_forward_step, groups.cp) if cp > 1 else forward_step,
        data_iterator=[iter(batches) for _ in chunks],
        model=chunks,
        num_microbatches=microbatches,
        seq_length=seq,
        micro_batch_size=1,
    )
    sum_tied_embedding_grads(chunks, groups.embd)
    average_data_parallel([p for c in chunks for p in c.parameters()], groups.dp_cp, cp)
    pair = torch.stack([r["lm loss"] for r in reports]).sum(0) if reports else torch.zeros(2)
    if groups.pp_rank == pp - 1:
        dist.all_reduce(pair, group=groups.cp)
    return fb, pair, planned_schedule(settings, pp, recipe.parallel.vpp, microbatches).exchange
