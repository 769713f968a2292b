"""Execute one rank's row of a lowered schedule: a table from action kind to handler.

The interpreter holds the in-flight state (received inputs, forward outputs kept for backward,
received output gradients, input gradients waiting to be sent) and checks it: no compute before
its receive, nothing left over at the end. A backward runs inside its slice's context marked
``recompute`` (checkpointed layers re-run forward there and must not cache K/V again); a forward
runs under the activation meter's and the offloader's saved-tensor hooks. Under torch's profiler every action runs in
``record_function("<action>")``, named by the IR string the simulator's traces use (``F3.2``,
``1B0.7``, ``SEND_F3.2``), so a measured trace lines up with a simulated one; without a profiler
no label is entered. Sends the plan bounds wait for their link's send window, completed sends
are dropped after every action, receives are posted ahead of the ``RECV`` that waits for them
where ``plan/schedule/recv_posts.py`` places them, the sends and receives between two computes go
out as one batch, and a meter counts in-flight buffers (``runtime/pipeline/p2p.py``, ``plan/schedule/walk.py``).
An evaluation step runs a forward-only schedule (``plan.schedule.executable_forward_only``): no graph is kept.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Optional, Sequence

import torch
from torch.profiler import record_function

from megatron_slim.plan.schedule.ir import Action, Kind, Schedule
from megatron_slim.plan.schedule.recv_posts import receive_posts
from megatron_slim.plan.schedule.validate import format_grid
from megatron_slim.plan.schedule.vocab import EmbeddingJoin, Join, every_rank_joins, vocab_joins
from megatron_slim.plan.schedule.walk import bounded_sends
from megatron_slim.runtime.pipeline.grad_sync import GradSync, ParamSync
from megatron_slim.runtime.pipeline.kv_cache import KVCacheStore
from megatron_slim.runtime.pipeline.loss import SlicedLoss
from megatron_slim.runtime.pipeline.memory_meter import ActivationMeter
from megatron_slim.runtime.pipeline.offload import ActivationOffload
from megatron_slim.runtime.pipeline.p2p import P2P
from megatron_slim.runtime.pipeline.slice_context import SliceContext, SliceInfo
from megatron_slim.runtime.pipeline.stage_ops import PipelineStateError, RunState, StageOps, Unit
from megatron_slim.runtime.pipeline.vocab import VocabExchange


class PipelineInterpreter:
    def __init__(
        self,
        schedule: Schedule,
        rank: int,
        ops: StageOps,
        p2p: Optional[P2P],
        slice_lengths: Sequence[int],
        context: SliceContext,
        kv_stores: Sequence[KVCacheStore],
        loss: SlicedLoss,
        meter: Optional[ActivationMeter] = None,
        grad_sync: Optional[GradSync] = None,
        param_sync: Optional[ParamSync] = None,
        offload: Optional[ActivationOffload] = None,
        vocab: Optional[VocabExchange] = None,
    ) -> None:
        """``vocab``: the output layer runs on every pipeline rank (``runtime/pipeline/vocab.py``);
        the last stage's loss function then returns the slice's ``(labels, loss_mask)``."""
        if not schedule.is_lowered:
            raise ValueError("the interpreter runs lowered schedules (plan.schedule.add_communication)")
        if schedule.has_split_backward:
            raise ValueError(
                "split input/weight backward (I/W) schedules are simulated, not executed: "
                "merge them with plan.schedule.merge_backward"
            )
        if len(slice_lengths) != schedule.num_slices:
            raise ValueError(f"{len(slice_lengths)} slice lengths for {schedule.num_slices} slices")
        self.schedule, self.rank, self.ops, self.p2p = schedule, rank, ops, p2p
        self.lengths = list(slice_lengths)
        self.starts = [sum(self.lengths[:j]) for j in range(len(self.lengths))]
        self.ctx, self.kv, self.loss, self.meter, self.offload = context, kv_stores, loss, meter, offload
        self.grad_sync, self.param_sync, self.forward_only = grad_sync, param_sync, schedule.forward_only
        self.row = list(schedule.ranks[rank])
        self.vocab = vocab
        self._vocab_joins: dict[int, tuple[Join, ...]] = vocab_joins(schedule, rank)[0] if vocab is not None else {}
        self.state = RunState()
        self._bounded = {a for r, a in bounded_sends(schedule) if r == rank} if p2p is not None else set()
        self._in_flight = meter.p2p if meter is not None else None
        if p2p is not None:
            p2p.ledger = self._in_flight
        self._step = 0
        joins = every_rank_joins(schedule) if vocab is not None else ()  # no rank passes a join alone
        self._posts = receive_posts(schedule, joins)[rank] if p2p is not None else {}
        self.posted_ahead = 0  # receives found posted when their RECV action came (all but the first few)
        self._handlers = {
            Kind.F: self._forward,
            Kind.B: self._backward,
            Kind.SEND_F: self._send_forward,
            Kind.RECV_F: self._recv,
            Kind.SEND_B: self._send_backward,
            Kind.RECV_B: self._recv,
        }

    # ---- helpers ----------------------------------------------------------------------------
    def _stage(self, a: Action) -> int:
        return self.schedule.stage(self.rank, a.chunk)

    def _local(self, stage: int) -> bool:
        return 0 <= stage < self.schedule.num_stages and self.schedule.placement(stage)[0] == self.rank

    def _fail(self, message: str) -> PipelineStateError:
        return PipelineStateError(
            f"rank {self.rank} step {self._step} {self.row[self._step]}: {message}\n"
            + format_grid(self.schedule, {self.rank: self._step})
        )

    def _slice_info(self, a: Action, recompute: bool = False) -> SliceInfo:
        return SliceInfo(
            a.microbatch,
            a.slice,
            self.schedule.num_slices,
            self.starts[a.slice],
            self.lengths[a.slice],
            self.forward_only,
            recompute,
        )

    def _saved_tensor_hooks(self, unit: Unit):
        """What watches (meter) and moves (offload) the activations a forward action saves."""
        if self.forward_only:
            return nullcontext()
        if self.meter is not None:
            return self.meter.track(unit, self.offload)
        return self.offload.track() if self.offload is not None else nullcontext()

    # ---- handlers -----------------------------------------------------------------------------
    def _forward(self, a: Action) -> None:
        unit, stage = a.unit, self._stage(a)
        inp = None
        if stage > 0:
            if unit not in self.state.inputs:
                raise self._fail("forward before its input was received")
            inp = self.state.inputs.pop(unit)
            self._consumed(Kind.RECV_F, unit)
        if self.param_sync is not None:
            self.param_sync.before_forward(a.chunk)
        with self.ctx.enter(self._slice_info(a)), self._saved_tensor_hooks(unit):
            output, loss_func = self.ops.forward(a.chunk, inp)
            if stage == self.schedule.num_stages - 1 and self.vocab is not None:
                self.vocab.keep(a.microbatch, a.slice, output, loss_func(output))
                if not self.forward_only:  # the exchange keeps the values; backward needs only the graph
                    self.ops.release_output(output)
            elif stage == self.schedule.num_stages - 1:
                self.loss.add(a.microbatch, a.slice, loss_func(output), keep_graph=not self.forward_only)
        if self.forward_only and a.slice == self.schedule.num_slices - 1:
            self.kv[a.chunk].drop_microbatch(a.microbatch)
        if stage < self.schedule.num_stages - 1 and self._local(stage + 1):
            _, next_chunk = self.schedule.placement(stage + 1)
            handed = output.detach()
            self.state.inputs[(next_chunk, a.microbatch, a.slice)] = handed.requires_grad_(not self.forward_only)
        if not self.forward_only:
            self.state.outputs[unit] = (inp, output)
        elif stage < self.schedule.num_stages - 1 and not self._local(stage + 1):
            self.state.outputs[unit] = (None, output)  # kept only until SEND_F

    def _send_forward(self, a: Action) -> None:
        assert self.p2p is not None  # a schedule with communication actions runs with a P2P link
        unit, stage = a.unit, self._stage(a)
        if unit not in self.state.outputs:
            raise self._fail("sending an output that was not computed")
        output = self.state.outputs[unit][1]
        dst = self.schedule.placement(stage + 1)[0]
        self.p2p.send(output, dst, self.p2p.tag(False, stage + 1, a.microbatch, a.slice), a in self._bounded)
        if self.forward_only:
            del self.state.outputs[unit]
        else:
            self.ops.release_output(output)

    def _message(self, a: Action) -> tuple[tuple[int, ...], torch.dtype, int, int]:
        """(shape, dtype, source rank, tag) of the message ``RECV`` ``a`` waits for."""
        assert self.p2p is not None  # a schedule with communication actions runs with a P2P link
        stage, backward = self._stage(a), a.kind is Kind.RECV_B
        src = self.schedule.placement(stage + 1 if backward else stage - 1)[0]
        shape = tuple(self.ops.tensor_shape(a.microbatch, a.slice))
        return shape, self.ops.dtype, src, self.p2p.tag(backward, stage, a.microbatch, a.slice)

    def _post(self, a: Action) -> None:
        assert self.p2p is not None  # a schedule with communication actions runs with a P2P link
        buffer = self.p2p.post(*self._message(a))
        if self._in_flight is not None:  # held from its posting, as the simulator counts it
            self._in_flight.add((a.kind, a.unit), buffer.nbytes, received=True)

    def _recv(self, a: Action) -> None:
        """Wait for the receive posted ahead (``plan.schedule.recv_posts``), or post it here."""
        assert self.p2p is not None  # a schedule with communication actions runs with a P2P link
        message = self._message(a)
        if self.p2p.is_posted(message[2], message[3]):
            self.posted_ahead += 1
        else:
            self._post(a)
        t = self.p2p.recv(*message)
        if a.kind is Kind.RECV_F:
            self.state.inputs[a.unit] = t.requires_grad_(not self.forward_only)
        else:
            self.state.grads[a.unit] = t

    def _backward(self, a: Action) -> None:
        unit, stage = a.unit, self._stage(a)
        if unit not in self.state.outputs:
            raise self._fail("backward of a unit with no forward output")
        inp, output = self.state.outputs.pop(unit)
        grad = None
        if stage == self.schedule.num_stages - 1 and self.vocab is not None:
            grad = self.vocab.hidden_grad(a.microbatch, a.slice)
        elif stage == self.schedule.num_stages - 1:
            output = self.loss.backward_tensor(a.microbatch, a.slice)
        else:
            if unit not in self.state.grads:
                raise self._fail("backward before its output gradient was received")
            grad = self.state.grads.pop(unit)
            self._consumed(Kind.RECV_B, unit)
        if self.grad_sync is not None:
            self.grad_sync.before_backward(a.chunk, self._step)
        with self.ctx.enter(self._slice_info(a, recompute=True)):  # checkpointed layers re-run forward here
            input_grad = self.ops.backward(inp, output, grad)
        if self.grad_sync is not None:
            self.grad_sync.after_backward(a.chunk, self._step)
        if self.meter is not None:
            self.meter.release(unit)
        if stage > 0:
            if input_grad is None:
                raise self._fail("backward returned no input gradient on a stage that has an input")
            if self._local(stage - 1):
                _, prev_chunk = self.schedule.placement(stage - 1)
                self.state.grads[(prev_chunk, a.microbatch, a.slice)] = input_grad
            else:
                self.state.to_send[unit] = input_grad

    def _send_backward(self, a: Action) -> None:
        assert self.p2p is not None  # a schedule with communication actions runs with a P2P link
        stage = self._stage(a)
        if a.unit not in self.state.to_send:
            raise self._fail("sending an input gradient that was not computed")
        dst = self.schedule.placement(stage - 1)[0]
        tag = self.p2p.tag(True, stage - 1, a.microbatch, a.slice)
        self.p2p.send(self.state.to_send.pop(a.unit), dst, tag, a in self._bounded)

    def _consumed(self, kind: Kind, unit: Unit) -> None:
        """A received buffer becomes the input of the compute that starts now."""
        if self._in_flight is not None:
            self._in_flight.remove((kind, unit))

    # ---- run ----------------------------------------------------------------------------------
    def run(self) -> None:
        if self.grad_sync is not None and not self.forward_only:
            self.grad_sync.start()
        if self.param_sync is not None:
            self.param_sync.start()
        for step, a in enumerate(self.row):
            self._step = step
            if a.kind.is_compute:  # its received input stops being in flight first, as the simulator counts
                self._consumed(Kind.RECV_F if a.kind is Kind.F else Kind.RECV_B, a.unit)
            for recv in self._posts.get(step, ()):
                if recv != a:
                    self._post(recv)
            if self.p2p is not None and (a.kind.is_compute or self._vocab_joins.get(step)):
                self.p2p.flush()  # the communication point ends: its sends and receives go out as one batch
            self._meet_vocab(step)
            label = record_function(str(a)) if torch.autograd._profiler_enabled() else nullcontext()
            with label, self.ctx.exchanging(a):  # a paired compute meets its context-exchange partner
                self._handlers[a.kind](a)
            if self.p2p is not None:
                self.p2p.poll()
        if self.p2p is not None:
            self.p2p.flush()
        self._meet_vocab(len(self.row))
        if self.vocab is not None and self.vocab.embedding is not None:
            self.vocab.embedding.finish()
        if self.p2p is not None:
            self.p2p.wait_all()
        if self.grad_sync is not None and not self.forward_only:
            self.grad_sync.finish()
        self._check_drained()

    def _meet_vocab(self, position: int) -> None:
        """The vocabulary exchanges planned after the row's first ``position`` steps, in order."""
        for join in self._vocab_joins.get(position, ()):
            assert self.vocab is not None  # joins are planned only with a vocabulary exchange
            if not isinstance(join, EmbeddingJoin):
                self.vocab.join(join.microbatch)
            elif self.vocab.embedding is not None:
                self.vocab.embedding.meet(join)  # stage 0: the lookup its F makes; else serve it

    def _check_drained(self) -> None:
        left = {
            name: sorted(getattr(self.state, name))
            for name in ("inputs", "outputs", "grads", "to_send")
            if getattr(self.state, name)
        }
        stores = [f"chunk {c}: {s.describe()}" for c, s in enumerate(self.kv) if not s.is_empty()]
        vocab_left = self.vocab is not None and not self.vocab.is_drained()
        vocab_left |= (
            self.vocab is not None and self.vocab.embedding is not None and not self.vocab.embedding.is_drained()
        )
        if left or stores or not self.loss.is_drained() or vocab_left:
            raise PipelineStateError(f"rank {self.rank}: state left after the schedule: {left} {stores}")


__all__ = ["PipelineInterpreter", "PipelineStateError", "RunState", "StageOps"]
