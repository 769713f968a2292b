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
attention (``runtime.pipeline.cp_slice_attention``) on the model's own CP group; a model built with
a CP engine's core attention (``megatron.cp.schedule``) runs that engine instead, one slice per
microbatch, and its plan sets the rows between stages (``stage_rows``). Losses are normalised as
megatron does on each CP rank (``runtime.pipeline.loss``); DDP averages over data x CP ranks.

Recomputation is megatron-core's (the chunks' ``TransformerConfig.recompute_*``); the interpreter
runs each backward in its slice's context so a recomputed layer reads the cached K/V prefix.
``SlimPipeSettings.exchange`` runs the schedule's context-exchange pairs in training calls
(``runtime.pipeline.context_exchange``; any vpp, CP under zigzag query-out; on a non-gloo pipeline
group its messages get a group of their own, ``exchange_group``). ``SlimPipeSettings.offload_ratio``
moves that share of each chunk's layers' saved activations to host memory until backward
(``offload_layers``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megatron_slim.megatron.model.vocab_head import distributed_lookup
from megatron_slim.megatron.slimpipe.call_plan import (
    agree_on_plan,
    pipeline_group,
    planned_schedule,
    refuse_unsupported_call,
    tensor_group,
)
from megatron_slim.megatron.slimpipe.exchange_group import exchange_cp_group, exchange_group
from megatron_slim.megatron.slimpipe.offload_layers import attach_offload
from megatron_slim.megatron.slimpipe.settings import ForwardBackwardFunc, RunStats, SlimPipeSettings
from megatron_slim.megatron.slimpipe.stage import (
    Chunks,
    NonLossData,
    StageRows,
    attach_kv_stores,
    finalize_grads,
    model_chunks,
    reset_documents,
    run_timed,
    shared_documents,
    stage_ops,
    syncs,
)
from megatron_slim.plan.schedule.exchange_blocks import ExchangePlan
from megatron_slim.plan.schedule.executable import executable_forward_only
from megatron_slim.plan.schedule.ir import Schedule
from megatron_slim.plan.schedule.vocab import vocab_joins
from megatron_slim.runtime.pipeline.context_exchange import ContextExchange
from megatron_slim.runtime.pipeline.interpreter import PipelineInterpreter
from megatron_slim.runtime.pipeline.loss import SlicedLoss
from megatron_slim.runtime.pipeline.memory_meter import ActivationMeter
from megatron_slim.runtime.pipeline.p2p import P2P
from megatron_slim.runtime.pipeline.slice_context import SliceContext
from megatron_slim.runtime.pipeline.sliced_data import SlicedIterator
from megatron_slim.runtime.pipeline.vocab import VocabExchange
from megatron_slim.runtime.pipeline.vocab_embedding import EmbeddingExchange
from megatron_slim.runtime.pipeline.vocab_weights import VocabHead


def make_forward_backward_func(
    settings: SlimPipeSettings,
    context: Optional[SliceContext] = None,
    vocab_head: Optional[VocabHead | Callable[[list], VocabHead]] = None,
    stage_rows: Optional[StageRows] = None,
    call_documents: Optional[Callable[[], list]] = None,
) -> ForwardBackwardFunc:
    """``context``: the ``SliceContext`` the run's slices are entered in (the launcher's TP batch
    hook reads it); a new one by default. ``vocab_head``: run the word embedding, output layer and
    loss on every pipeline rank (``runtime/pipeline/vocab_embedding.py``, ``vocab.py``), or what gives
    it from the call's model chunks (the launcher's, ``vocab_launch.py``); the forward
    step's loss function then returns the slice's ``(labels, loss_mask)`` and the last stage's model
    its final hidden states. ``stage_rows(microbatch, slice)``: this rank's rows between stages if a
    CP plan sets them (``train.cp``). ``call_documents()``: each microbatch's document lengths in the
    call, known on every stage (a CP engine's plans: ``engine_slices``), so stages that read no batch
    attend within documents too."""
    stats = RunStats()
    context = context if context is not None else SliceContext()

    def forward_backward_slimpipe(
        *,
        forward_step_func,
        data_iterator,
        model,
        num_microbatches: int,
        seq_length: int,
        micro_batch_size: int,
        decoder_seq_length=None,
        forward_only: bool = False,
        collect_non_loss_data: bool = False,
        first_val_step=None,
        adjust_tensor_shapes_fn=None,
        p2p_communicator=None,
        pg_collection=None,
        grad_finalize_pgs=None,
        force_all_reduce=False,
        **unused: Any,
    ):
        refuse_unsupported_call(settings, seq_length, adjust_tensor_shapes_fn)
        chunks = model_chunks(model)
        group = pipeline_group(pg_collection, p2p_communicator)
        schedule = planned_schedule(settings, group.size(), len(chunks.models), num_microbatches, forward_only)
        stats.schedule_digest = schedule.digest()
        agree_on_plan(stats.schedule_digest, group, stats, chunks.first_param.device)
        shape = (num_microbatches, seq_length, group, pg_collection, chunks.first_param.device)
        data_iterator, documents = _documents_of_call(settings, call_documents, context, data_iterator, *shape)
        non_loss = collect_non_loss_data and forward_only
        head = vocab_head(chunks.models) if callable(vocab_head) else vocab_head
        run = _Run(settings, chunks, group, schedule, forward_only, non_loss, head, stage_rows)
        loss = run.interpret(forward_step_func, data_iterator, micro_batch_size, context, stats, documents)
        if not forward_only and getattr(chunks.config, "finalize_model_grads_func", None) is not None:
            finalize_grads(chunks, loss, pg_collection or grad_finalize_pgs, force_all_reduce)
        last_stage = group.rank() == group.size() - 1
        return list(loss.reports) if last_stage else []

    function: Any = forward_backward_slimpipe  # carries the run's stats and settings for its callers
    function.stats = stats
    function.settings = settings
    return function


def _documents_of_call(
    settings, call_documents, context, data_iterator, num_microbatches, seq_length, group, pg_collection, device
):
    """(the data iterator, each microbatch's documents or None): from ``call_documents`` (a CP engine's
    plans), or handed from the first stage's TP rank 0 to the ranks that read no batch (packed windows)."""
    documents = call_documents() if call_documents is not None else None
    tp_group = tensor_group(pg_collection) if settings.share_documents else None
    if settings.share_documents and (group.size() > 2 or (tp_group is not None and tp_group.size() > 1)):
        data_iterator, documents = shared_documents(
            data_iterator, num_microbatches, seq_length, group, tp_group, device
        )
        context.documents_on_every_tp_rank = True  # TP rank 0's documents reached the other TP ranks
    return data_iterator, documents


@dataclass(frozen=True)
class _Run:
    """One call's plan on this rank: its chunks, its pipeline group and the schedule they run."""

    settings: SlimPipeSettings
    chunks: Chunks
    group: Any
    schedule: Schedule
    forward_only: bool
    non_loss_only: bool  # collect_non_loss_data in a forward-only call
    vocab_head: Optional[VocabHead] = None
    stage_rows: Optional[StageRows] = None

    def interpret(
        self,
        forward_step_func,
        data_iterator,
        micro_batch_size: int,
        context: SliceContext,
        stats: RunStats,
        documents: Optional[list] = None,
    ) -> Any:
        """Run this rank's part of the schedule; returns the loss (or non-loss data) collector.
        ``documents``: each microbatch's document lengths as the first stage read them (or None)."""
        settings, chunks, schedule, forward_only = self.settings, self.chunks, self.schedule, self.forward_only
        models, config, device = chunks.models, chunks.config, chunks.first_param.device
        rank = self.group.rank()
        ledger, stores = attach_kv_stores(chunks, context, settings.slice_lengths, settings.attention_backend)
        iterators = list(data_iterator) if isinstance(data_iterator, (list, tuple)) else [data_iterator] * len(models)
        reset_documents(context, documents)
        sliced = [SlicedIterator(it, settings.slice_lengths, context) if it is not None else None for it in iterators]
        lengths, rows = settings.slice_lengths, self.stage_rows
        ops = stage_ops(chunks, forward_step_func, sliced, self.non_loss_only, lengths, micro_batch_size, rows)
        p2p = self._p2p(device)
        loss = self._loss()
        kv_storages = lambda: set().union(*(s.storage_ptrs() for s in stores))  # noqa: E731
        params = [p for m in models for p in m.parameters()]
        meter = ActivationMeter(params, kv_storages) if settings.measure_memory else None
        offload, hooks = attach_offload(models, 0.0 if forward_only else settings.offload_ratio, kv_storages)
        grad_sync, param_sync = syncs(chunks, schedule.ranks[rank], forward_only)
        executed = executable_forward_only(schedule) if forward_only else schedule
        vocab = self._vocab(micro_batch_size, executed)
        context.exchange = self._exchange(chunks)
        interpreter = PipelineInterpreter(
            executed,
            rank,
            ops,
            p2p,
            settings.slice_lengths,
            context,
            stores,
            loss,
            meter=meter,
            grad_sync=grad_sync,
            param_sync=param_sync,
            offload=offload,
            vocab=vocab,
        )
        try:
            with distributed_lookup(models[0], vocab.embedding if vocab is not None else None):
                run_timed(interpreter, config)
            if context.exchange is not None:
                context.exchange.drain()  # servers still serving this call's last blocks
        finally:
            for hook in hooks:
                hook.remove()
            exchange, context.exchange = context.exchange, None
        if vocab is not None:
            loss.reports.extend(vocab.reports)
        _record(stats, meter, ledger, offload, exchange)
        return loss

    def _vocab(self, micro_batch_size: int, executed: Schedule) -> Optional[VocabExchange]:
        if self.vocab_head is None:
            return None
        if getattr(self.chunks.config, "calculate_per_token_loss", False) or self.non_loss_only:
            raise ValueError(
                "schedule.vocab_parallel: per-token loss and non-loss data are not supported; allowed: "
                "Megatron's default per-microbatch loss"
            )
        s, rank, lengths, config = self.schedule, self.group.rank(), self.settings.slice_lengths, self.chunks.config
        tag_base = 2 * s.num_stages * s.num_microbatches * s.num_slices  # above the schedule's own tags
        embedding = EmbeddingExchange(
            self.vocab_head.lookup_head, rank, vocab_joins(executed, rank)[1], lengths, micro_batch_size,
            config.hidden_size, s.num_microbatches, tag_base + 4 * s.num_microbatches * s.num_slices, self.forward_only,
            self.stage_rows,
        )  # fmt: skip
        return VocabExchange(
            self.vocab_head, rank, lengths, micro_batch_size, config.hidden_size, s.num_microbatches, tag_base,
            self.forward_only, embedding, self.stage_rows,
        )  # fmt: skip

    def _exchange(self, chunks: Chunks) -> Optional[ContextExchange]:
        """This rank's side of the schedule's context-exchange pairs; None without any."""
        if not self.schedule.exchange:
            return None
        ranks = dist.get_process_group_ranks(self.group)
        plan = ExchangePlan.from_text(self.schedule.exchange)
        group, device, cp_group = exchange_group(self.group), chunks.first_param.device, None
        if chunks.cp > 1:
            from megatron.core import parallel_state

            cp_group = exchange_cp_group(parallel_state.get_context_parallel_group())
        return ContextExchange(plan, self.group.rank(), group, ranks, chunks.cp, device, cp_group)

    def _p2p(self, device: torch.device) -> Optional[P2P]:
        """The send/receive pairs between pipeline stages; none for a single stage."""
        if self.group.size() == 1:
            return None
        schedule = self.schedule
        ranks = dist.get_process_group_ranks(self.group)
        return P2P(self.group, ranks, device, schedule.num_stages, schedule.num_microbatches, self.settings.num_slices)

    def _loss(self) -> Any:
        """What collects the last stage's loss reports (or, forward only, its non-loss data)."""
        if self.non_loss_only:
            return NonLossData()
        per_token = getattr(self.chunks.config, "calculate_per_token_loss", False)
        return SlicedLoss(self.schedule.num_microbatches, self.settings.num_slices, per_token, cp_size=self.chunks.cp)


def _record(stats: RunStats, meter, ledger, offload, exchange: Optional[ContextExchange]) -> None:
    """What the call measured: exchanged tokens, peak activation / K/V / P2P bytes, offloaded bytes."""
    stats.exchanged_tokens = exchange.sent_tokens if exchange is not None else 0
    stats.served_blocks = exchange.served_blocks if exchange is not None else 0
    if meter is not None:
        stats.peak_activation_bytes = meter.peak_bytes
        stats.peak_kv_bytes = ledger.peak_bytes
        stats.peak_p2p_bytes = meter.p2p.peak_bytes
    stats.offloaded_bytes = offload.moved_bytes if offload is not None else 0
