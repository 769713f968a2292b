"""SlimPipe as a megatron-core forward-backward function.

``make_forward_backward_func(settings)`` returns a function with the keyword contract of
``megatron.core.pipeline_parallel.schedules.forward_backward_pipelining_*`` for megatron-core
0.14 .. 0.19 (unknown keywords are accepted; the ones that change behaviour and are not supported
raise). It builds the slice schedule for the call's (pp, vpp, microbatches, slices) with
``plan.schedule.executable`` (lowered, validated; ``forward_only``: its validated forward-only
form), checks that every pipeline rank holds the same plan, and runs the interpreter on megatron's
model chunks with megatron's hooks: ``no_sync_func``, ``grad_sync_func``,
``finalize_model_grads_func``, ``grad_scale_func`` (inside megatron's ``backward_step``),
``deallocate_pipeline_outputs``, ``timers``. It returns what megatron's schedules return: one loss
report per microbatch on the last pipeline stage, an empty list elsewhere.

Context parallelism: every slice is split zigzag-wise over the CP ranks by megatron's own data
path (``get_batch_on_this_cp_rank`` on the slice the forward step receives), so slice lengths must
be multiples of ``2 * cp`` (times ``tp`` under sequence parallelism: the hidden states between
stages are ``[slice / cp / tp, b, h]``). ``SliceCoreAttention`` then runs the query-out CP slice
attention (``runtime.pipeline.cp_slice_attention``) on the model's own CP group (a model built with
a CP engine's core attention, ``megatron.cp_schedule``, runs that engine instead, one slice per
microbatch). Losses are normalised as megatron does on each CP rank (``runtime.pipeline.loss``),
and DDP averages over data x context parallel ranks as it always does.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import torch
import torch.distributed as dist

from megatron_slim.megatron import compat
from megatron_slim.megatron.slimpipe.slicing import attach_slicing
from megatron_slim.plan.cost.slicing import is_aligned, slice_alignment
from megatron_slim.plan.schedule.executable import executable, executable_forward_only
from megatron_slim.plan.schedule.ir import Schedule
from megatron_slim.runtime.agreement import check_agreement
from megatron_slim.runtime.pipeline.grad_sync import GradSync, ParamSync
from megatron_slim.runtime.pipeline.interpreter import PipelineInterpreter, StageOps, last_backward_steps
from megatron_slim.runtime.pipeline.kv_cache import ByteLedger, KVCacheStore
from megatron_slim.runtime.pipeline.loss import SlicedLoss
from megatron_slim.runtime.pipeline.memory_meter import ActivationMeter
from megatron_slim.runtime.pipeline.p2p import P2P
from megatron_slim.runtime.pipeline.slice_context import SliceContext
from megatron_slim.runtime.pipeline.sliced_data import SlicedIterator


@dataclass(frozen=True)
class SlimPipeSettings:
    slice_lengths: tuple[int, ...]  # the slice plan: what the simulator was given too
    kind: str = "slimpipe"  # 1f1b and interleaved run through the same interpreter (one slice)
    attention_backend: Optional[str] = None
    measure_memory: bool = False

    @property
    def num_slices(self) -> int:
        return len(self.slice_lengths)


@dataclass
class RunStats:
    """Measured by the last call with ``measure_memory``: per model chunk on this rank."""

    peak_activation_bytes: int = 0
    peak_kv_bytes: int = 0
    schedule_digest: str = ""
    agreed_digests: set = field(default_factory=set)


class ForwardBackwardFunc(Protocol):
    """Megatron's ``forward_backward_func``, carrying its run's stats and settings."""

    stats: RunStats
    settings: SlimPipeSettings

    def __call__(self, **kwargs: Any) -> list: ...


class _NonLossData:
    """``collect_non_loss_data``: keep what ``loss_func(output, non_loss_data=True)`` returns."""

    def __init__(self) -> None:
        self.reports: list = []

    def add(self, microbatch, slice_, outputs, keep_graph):
        self.reports.append(outputs)

    def is_drained(self) -> bool:
        return True


def _pp_group(pg_collection, p2p_communicator):
    for source in (pg_collection, p2p_communicator):
        group = getattr(source, "pp", None) or getattr(source, "pp_group", None)
        if group is not None:
            return group
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_group()


def _agree_on_plan(digest: str, group, stats: RunStats, device: torch.device) -> None:
    if digest in stats.agreed_digests or group.size() == 1:
        return
    check_agreement(digest, group, device=device, ranks="pipeline ranks", what="SlimPipe schedule",
                    remedy="every rank must generate it from the same schedule settings")
    stats.agreed_digests.add(digest)


def _check_slice_alignment(lengths, cp: int, sp_tp: int) -> None:
    """Each slice is cut into 2*cp zigzag chunks, and (sequence parallel) each CP shard into ``sp_tp``."""
    unit = slice_alignment(cp, sp_tp, sequence_parallel=True)
    bad = sorted({n for n in lengths if not is_aligned(n, unit)})
    if bad:
        raise ValueError(f"SlimPipe slice lengths {tuple(lengths)}: {bad} are not multiples of {unit} tokens "
                         f"(context parallel size {cp}, sequence-parallel tp {sp_tp}); allowed: slice lengths "
                         f"that are multiples of {unit} (recipes: slice_alignment)")


def check_schedule_groups(*args: Any, **kwargs: Any) -> None:
    """Refuse what ``get_forward_backward_func(*args, **kwargs)`` asks for that SlimPipe cannot run:
    0.19's ``schedule_pg_collection`` (third positional) as a ``MultiModuleProcessGroupCollection``
    (pipelines of several modules, e.g. a vision encoder before the language model)."""
    groups = kwargs.get("schedule_pg_collection", args[2] if len(args) > 2 else None)
    if type(groups).__name__ == "MultiModuleProcessGroupCollection":
        raise ValueError("--use-slimpipe: multi-module pipelines (a MultiModuleProcessGroupCollection from "
                         "get_forward_backward_func(schedule_pg_collection=...)) are not supported; allowed: one "
                         "GPT model per pipeline rank")


def planned_schedule(settings: SlimPipeSettings, pp: int, vpp: int, num_microbatches: int) -> Schedule:
    """The schedule every pipeline rank runs for one call (the simulator times the same one)."""
    return executable(settings.kind, pp, vpp, num_microbatches, settings.num_slices)


@dataclass(frozen=True)
class _Chunks:
    """This rank's model chunks for one call, and what their config says about running them."""

    models: list
    config: Any
    first_param: torch.Tensor  # its device is the rank's; its dtype the default pipeline dtype
    cp: int
    sp_tp: int  # tensor-parallel size under sequence parallelism, else 1: stages pass [slice/cp/sp_tp, b, h]


def _model_chunks(model) -> _Chunks:
    from megatron.core.utils import get_model_config

    models = list(model) if isinstance(model, (list, tuple)) else [model]
    config = get_model_config(models[0])
    sp_tp = getattr(config, "tensor_model_parallel_size", 1) if getattr(config, "sequence_parallel", False) else 1
    return _Chunks(models, config, next(models[0].parameters()), getattr(config, "context_parallel_size", 1) or 1,
                   sp_tp)


def _refuse_unsupported_call(settings: SlimPipeSettings, seq_length: int, adjust_tensor_shapes_fn) -> None:
    if adjust_tensor_shapes_fn is not None:
        raise ValueError("adjust_tensor_shapes_fn: not supported by SlimPipe (ModelOpt distillation); "
                         "run without --use-slimpipe")
    if sum(settings.slice_lengths) != seq_length:
        raise ValueError(f"seq_length={seq_length}: the SlimPipe slice plan covers "
                         f"{sum(settings.slice_lengths)} tokens ({settings.slice_lengths})")


def _attach_kv_stores(chunks: _Chunks, context: SliceContext, settings: SlimPipeSettings):
    """One K/V cache per chunk, all counted by one ledger; the chunks' slice attention reads them."""
    ledger = ByteLedger()
    stores = [KVCacheStore(ledger) for _ in chunks.models]
    for m, store in zip(chunks.models, stores):
        if attach_slicing(m, context, store, settings.attention_backend) == 0:
            raise ValueError("--use-slimpipe: the model has no SliceCoreAttention; build it with "
                             "megatron_slim's layer spec (megatron_slim.megatron.hooks patches the spec)")
    _check_slice_alignment(settings.slice_lengths, chunks.cp, chunks.sp_tp)
    if getattr(chunks.config, "num_microbatches_with_partial_activation_checkpoints", None) is not None:
        raise ValueError("--num-microbatches-with-partial-activation-checkpoints: not supported by SlimPipe "
                         "(its forward steps are slices, not microbatches); drop it")
    return ledger, stores


def _stage_ops(chunks: _Chunks, forward_step_func, sliced: list, non_loss_only: bool,
               slice_lengths: tuple[int, ...], micro_batch_size: int) -> StageOps:
    """Megatron's forward step, backward step and output deallocation, as the interpreter calls them."""
    from megatron.core.utils import get_attr_wrapped_model

    models, config, device = chunks.models, chunks.config, chunks.first_param.device

    def forward(chunk: int, inp):
        get_attr_wrapped_model(models[chunk], "set_input_tensor")(inp)
        autocast = (torch.autocast(device.type, dtype=config.autocast_dtype)
                    if getattr(config, "enable_autocast", False) else contextlib.nullcontext())
        with autocast:
            # megatron passes a third argument only for partial activation checkpointing
            # (refused above); in 0.19 a third positional is ``return_schedule_plan``.
            output, loss_func = forward_step_func(sliced[chunk], models[chunk])
        if non_loss_only and loss_func is not None:
            loss_func = functools.partial(loss_func, non_loss_data=True)
        return output, loss_func

    def backward(inp, out, grad):
        grads = compat.backward_step(inp, out, grad, config)
        return grads[0] if isinstance(grads, (list, tuple)) else grads

    def release(out):
        from megatron.core.pipeline_parallel.schedules import deallocate_output_tensor

        deallocate_output_tensor(out, getattr(config, "deallocate_pipeline_outputs", False))

    return StageOps(forward=forward, backward=backward, release_output=release,
                    dtype=config.pipeline_dtype or chunks.first_param.dtype,
                    tensor_shape=lambda mb, j: (slice_lengths[j] // chunks.cp // chunks.sp_tp, micro_batch_size,
                                            config.hidden_size))


def _syncs(chunks: _Chunks, rank_steps, forward_only: bool) -> tuple[GradSync, Optional[ParamSync]]:
    config = chunks.config
    chunk_params = [functools.partial(lambda m: m.parameters(), m) for m in chunks.models]
    grad_sync = GradSync(config.no_sync_func, config.grad_sync_func, chunk_params,
                         last_backward_steps(rank_steps, len(chunks.models)))
    param_sync = ParamSync(getattr(config, "param_sync_func", None), chunk_params) if not forward_only else None
    return grad_sync, param_sync


def _run_timed(interpreter: PipelineInterpreter, config) -> None:
    timer = config.timers("forward-backward", log_level=1) if getattr(config, "timers", None) else None
    if timer is not None:
        timer.start(barrier=getattr(config, "barrier_with_L1_time", False))
    interpreter.run()
    if timer is not None:
        timer.stop()


def _finalize_grads(chunks: _Chunks, loss, groups, force_all_reduce) -> None:
    per_token = getattr(chunks.config, "calculate_per_token_loss", False)
    tokens = loss.total_num_tokens if per_token else None
    if per_token and tokens is None:
        tokens = torch.zeros((), dtype=torch.int, device=chunks.first_param.device)  # not the last stage
    compat.finalize_model_grads(chunks.models, tokens, groups=groups, force_all_reduce=force_all_reduce or None,
                                fn=chunks.config.finalize_model_grads_func)


def make_forward_backward_func(settings: SlimPipeSettings,
                               context: Optional[SliceContext] = None) -> ForwardBackwardFunc:
    """``context``: the ``SliceContext`` the run's slices are entered in (the launcher's TP batch
    hook reads it); a new one by default."""
    stats = RunStats()
    context = context if context is not None else SliceContext()

    def forward_backward_slimpipe(*, forward_step_func, data_iterator, model, num_microbatches: int,
                                  seq_length: int, micro_batch_size: int, decoder_seq_length=None,
                                  forward_only: bool = False, collect_non_loss_data: bool = False,
                                  first_val_step=None, adjust_tensor_shapes_fn=None, p2p_communicator=None,
                                  pg_collection=None, grad_finalize_pgs=None, force_all_reduce=False,
                                  **unused: Any):
        _refuse_unsupported_call(settings, seq_length, adjust_tensor_shapes_fn)
        chunks = _model_chunks(model)
        models, config, device = chunks.models, chunks.config, chunks.first_param.device
        iterators = list(data_iterator) if isinstance(data_iterator, (list, tuple)) else [data_iterator] * len(models)
        group = _pp_group(pg_collection, p2p_communicator)
        pp, rank, vpp = group.size(), group.rank(), len(models)
        schedule = planned_schedule(settings, pp, vpp, num_microbatches)
        stats.schedule_digest = schedule.digest()
        _agree_on_plan(stats.schedule_digest, group, stats, device)
        ledger, stores = _attach_kv_stores(chunks, context, settings)
        sliced = [SlicedIterator(it, settings.slice_lengths) if it is not None else None for it in iterators]
        non_loss_only = collect_non_loss_data and forward_only
        ops = _stage_ops(chunks, forward_step_func, sliced, non_loss_only, settings.slice_lengths, micro_batch_size)
        p2p = P2P(group, dist.get_process_group_ranks(group), device, schedule.num_stages,
                  num_microbatches, settings.num_slices) if pp > 1 else None
        loss: Any = (_NonLossData() if non_loss_only else
                SlicedLoss(num_microbatches, settings.num_slices, getattr(config, "calculate_per_token_loss", False),
                           cp_size=chunks.cp))
        meter = ActivationMeter([p for m in models for p in m.parameters()],
                                lambda: set().union(*(s.storage_ptrs() for s in stores))) \
            if settings.measure_memory else None
        grad_sync, param_sync = _syncs(chunks, schedule.ranks[rank], forward_only)
        executed = executable_forward_only(schedule) if forward_only else schedule
        _run_timed(PipelineInterpreter(executed, rank, ops, p2p, settings.slice_lengths, context, stores, loss,
                                       meter=meter, grad_sync=grad_sync, param_sync=param_sync), config)
        if meter is not None:
            stats.peak_activation_bytes = meter.peak_bytes
            stats.peak_kv_bytes = ledger.peak_bytes
        if not forward_only and getattr(config, "finalize_model_grads_func", None) is not None:
            _finalize_grads(chunks, loss, pg_collection or grad_finalize_pgs, force_all_reduce)
        last_stage = rank == pp - 1
        return list(loss.reports) if last_stage else []

    function: Any = forward_backward_slimpipe  # carries the run's stats and settings for its callers
    function.stats = stats
    function.settings = settings
    return function
