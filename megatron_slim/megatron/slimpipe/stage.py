"""This rank's model chunks in one SlimPipe call, and how the interpreter reaches into them:
megatron's forward and backward steps (``stage_ops``), the chunks' K/V stores, gradient and
parameter syncs, megatron's timers and its gradient finalisation."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from megatron_slim.megatron import compat
from megatron_slim.megatron.slimpipe.slicing import attach_slicing
from megatron_slim.plan.cost.slicing import is_aligned, slice_alignment
from megatron_slim.plan.schedule.ir import Action, Kind
from megatron_slim.runtime.pipeline.grad_sync import GradSync, ParamSync
from megatron_slim.runtime.pipeline.interpreter import PipelineInterpreter, StageOps
from megatron_slim.runtime.pipeline.kv_cache import ByteLedger, KVCacheStore
from megatron_slim.runtime.pipeline.slice_context import SliceContext

StageRows = Callable[[int, int], int]  # (microbatch, slice) -> this rank's token rows between stages


def reset_documents(context: SliceContext, documents: Optional[list]) -> None:
    """A new call's document table: empty, or the first stage's lengths (``shared_documents``), which
    a stage that reads the batch too then checks its own reading against."""
    context.documents.clear()
    for microbatch, lengths in enumerate(documents or ()):
        if lengths is not None:
            context.documents.record(microbatch, lengths)


def one_chunk_source(data_iterator, what: str):
    """The one data iterator of a rank with one model chunk (``what`` needs it read up front)."""
    listed = isinstance(data_iterator, (list, tuple))
    if listed and len(data_iterator) != 1:
        raise ValueError(
            f"{what}: {len(data_iterator)} model chunks per rank; allowed: one (no virtual pipeline stages)"
        )
    return data_iterator[0] if listed else data_iterator


def shared_documents(
    data_iterator, num_microbatches: int, seq_length: int, pp_group, tp_group, device
) -> tuple[Any, Optional[list]]:
    """Each microbatch's document lengths on every rank that needs them, and the iterator to run on
    (``runtime/pipeline/stage_lengths``). Collective, in two steps: on a stage that reads batches
    (the first and last) TP rank 0 reads the call's microbatches and hands their lengths to the
    stage's other TP ranks (tensor parallel size > 1); with more than two stages the first stage
    then hands them over the pipeline group to the stages that read no batch."""
    from megatron_slim.runtime.pipeline.sliced_data import batch_documents
    from megatron_slim.runtime.pipeline.stage_lengths import (
        broadcast_lengths,
        read_microbatch_lengths,
        share_microbatch_lengths,
    )

    listed = isinstance(data_iterator, (list, tuple))
    source = one_chunk_source(data_iterator, "document lengths for the middle pipeline stages")
    measure = lambda batch: batch_documents(batch, seq_length)  # noqa: E731
    stages, stage = pp_group.size(), pp_group.rank()
    lengths = None
    if tp_group is not None and tp_group.size() > 1 and stage in (0, stages - 1):
        source, lengths = share_microbatch_lengths(source, num_microbatches, measure, tp_group, device)
    elif stage == 0 and stages > 2:
        source, lengths = read_microbatch_lengths(source, num_microbatches, measure)
    if stages > 2:
        lengths = broadcast_lengths(lengths if stage == 0 else None, pp_group, device)
    return ([source] if listed else source), lengths


class NonLossData:
    """``collect_non_loss_data``: keep what ``loss_func(output, non_loss_data=True)`` returns."""

    def __init__(self) -> None:
        self.reports: list = []

    def add(self, microbatch, slice_, outputs, keep_graph):
        self.reports.append(outputs)

    def is_drained(self) -> bool:
        return True


@dataclass(frozen=True)
class Chunks:
    """This rank's model chunks for one call, and what their config says about running them."""

    models: list
    config: Any
    first_param: torch.Tensor  # its device is the rank's; its dtype the default pipeline dtype
    cp: int
    sp_tp: int  # tensor-parallel size under sequence parallelism, else 1: stages pass [slice/cp/sp_tp, b, h]


def model_chunks(model) -> Chunks:
    from megatron.core.utils import get_model_config

    models = list(model) if isinstance(model, (list, tuple)) else [model]
    config = get_model_config(models[0])
    sp_tp = getattr(config, "tensor_model_parallel_size", 1) if getattr(config, "sequence_parallel", False) else 1
    return Chunks(models, config, next(models[0].parameters()), getattr(config, "context_parallel_size", 1) or 1, sp_tp)


def attach_kv_stores(
    chunks: Chunks, context: SliceContext, slice_lengths: tuple[int, ...], attention_backend: Optional[str]
) -> tuple[ByteLedger, list[KVCacheStore]]:
    """One K/V cache per chunk, all counted by one ledger; the chunks' slice attention reads them."""
    ledger = ByteLedger()
    stores = [KVCacheStore(ledger) for _ in chunks.models]
    for m, store in zip(chunks.models, stores):
        if attach_slicing(m, context, store, attention_backend) == 0:
            raise ValueError(
                "--use-slimpipe: the model has no SliceCoreAttention; build it with "
                "megatron_slim's layer spec (megatron_slim.megatron.hooks patches the spec)"
            )
    _check_slice_alignment(slice_lengths, chunks.cp, chunks.sp_tp)
    if getattr(chunks.config, "num_microbatches_with_partial_activation_checkpoints", None) is not None:
        raise ValueError(
            "--num-microbatches-with-partial-activation-checkpoints: not supported by SlimPipe "
            "(its forward steps are slices, not microbatches); drop it"
        )
    return ledger, stores


def _backward_step(inp, out, grad, config, detached: set[int]):
    """Megatron's backward step; for an input the chunk ran detached (``detached``: ids), or an
    output nothing trains into, the input gradient is zeros that no one below uses."""
    cut = inp is not None and id(inp) in detached
    detached.discard(id(inp))
    if cut or (out is not None and not out.requires_grad):
        if out is not None and out.requires_grad:  # this stage's own parameters train
            compat.backward_step(None, out, grad, config)
        return None if inp is None else torch.zeros_like(inp)  # zeros keep the schedule's sends
    grads = compat.backward_step(inp, out, grad, config)
    return grads[0] if isinstance(grads, (list, tuple)) else grads


def stage_ops(
    chunks: Chunks,
    forward_step_func,
    sliced: list,
    non_loss_only: bool,
    slice_lengths: tuple[int, ...],
    micro_batch_size: int,
    stage_rows: Optional[StageRows] = None,
) -> StageOps:
    """Megatron's forward step, backward step and output deallocation, as the interpreter calls them.
    ``stage_rows``: this rank's token rows of a (microbatch, slice) between stages when a
    data-dependent plan decides them (a CP engine); by default ``slice / cp / sp_tp``."""
    from megatron.core.utils import get_attr_wrapped_model

    models, config, device = chunks.models, chunks.config, chunks.first_param.device

    detached: set[int] = set()  # inputs a chunk ran without autograd (nothing below it trains)

    def forward(chunk: int, inp):
        if inp is not None and not getattr(models[chunk], "slim_input_needs_grad", True):
            detached.add(id(inp))
            inp = inp.detach()
        get_attr_wrapped_model(models[chunk], "set_input_tensor")(inp)
        autocast = (
            torch.autocast(device.type, dtype=config.autocast_dtype)
            if getattr(config, "enable_autocast", False)
            else contextlib.nullcontext()
        )
        with autocast:
            # megatron passes a third argument only for partial activation checkpointing
            # (refused above); in 0.19 a third positional is ``return_schedule_plan``.
            output, loss_func = forward_step_func(sliced[chunk], models[chunk])
        if non_loss_only and loss_func is not None:
            loss_func = functools.partial(loss_func, non_loss_data=True)
        return output, loss_func

    def backward(inp, out, grad):
        return _backward_step(inp, out, grad, config, detached)

    def release(out):
        from megatron.core.pipeline_parallel.schedules import deallocate_output_tensor

        deallocate_output_tensor(out, getattr(config, "deallocate_pipeline_outputs", False))

    def rows(mb: int, j: int) -> int:
        return stage_rows(mb, j) if stage_rows is not None else slice_lengths[j] // chunks.cp // chunks.sp_tp

    return StageOps(
        forward=forward,
        backward=backward,
        release_output=release,
        dtype=config.pipeline_dtype or chunks.first_param.dtype,
        tensor_shape=lambda mb, j: (rows(mb, j), micro_batch_size, config.hidden_size),
    )


def syncs(chunks: Chunks, rank_steps, forward_only: bool) -> tuple[GradSync, Optional[ParamSync]]:
    config = chunks.config
    chunk_params = [functools.partial(lambda m: m.parameters(), m) for m in chunks.models]
    grad_sync = GradSync(
        config.no_sync_func, config.grad_sync_func, chunk_params, last_backward_steps(rank_steps, len(chunks.models))
    )
    param_sync = ParamSync(getattr(config, "param_sync_func", None), chunk_params) if not forward_only else None
    return grad_sync, param_sync


def run_timed(interpreter: PipelineInterpreter, config) -> None:
    timer = config.timers("forward-backward", log_level=1) if getattr(config, "timers", None) else None
    if timer is not None:
        timer.start(barrier=getattr(config, "barrier_with_L1_time", False))
    interpreter.run()
    if timer is not None:
        timer.stop()


def finalize_grads(chunks: Chunks, loss, groups, force_all_reduce) -> None:
    per_token = getattr(chunks.config, "calculate_per_token_loss", False)
    tokens = loss.total_num_tokens if per_token else None
    if per_token and tokens is None:
        tokens = torch.zeros((), dtype=torch.int, device=chunks.first_param.device)  # not the last stage
    compat.finalize_model_grads(
        chunks.models,
        tokens,
        groups=groups,
        force_all_reduce=force_all_reduce or None,
        fn=chunks.config.finalize_model_grads_func,
    )


def _check_slice_alignment(lengths, cp: int, sp_tp: int) -> None:
    """Each slice is cut into 2*cp zigzag chunks, and (sequence parallel) each CP shard into ``sp_tp``."""
    unit = slice_alignment(cp, sp_tp, sequence_parallel=True)
    bad = sorted({n for n in lengths if not is_aligned(n, unit)})
    if bad:
        raise ValueError(
            f"SlimPipe slice lengths {tuple(lengths)}: {bad} are not multiples of {unit} tokens "
            f"(context parallel size {cp}, sequence-parallel tp {sp_tp}); allowed: slice lengths "
            f"that are multiples of {unit} (recipes: slice_alignment)"
        )


def last_backward_steps(row: Sequence[Action], vpp: int) -> dict[int, int]:
    """Per model chunk, the position of its last backward in this rank's row (-1: none)."""
    last = {c: -1 for c in range(vpp)}
    for step, a in enumerate(row):
        if a.kind is Kind.B:
            last[a.chunk] = step
    return last
