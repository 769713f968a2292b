"""Context exchange at run time: this rank's side of the schedule's pairs (``Schedule.exchange``).

A pair couples a compute action of a *sender* (the rank whose slice has the longer K/V prefix)
with one of a *peer* (``plan/schedule/exchange_blocks.py``). Both actions run their chunk's
layers in the same order (forward: first to last; backward: last to first), and at every
attention layer the two ends meet once:

* forward: the sender ships its slice's Q and the oldest ``moved`` tokens of its K/V prefix; the
  peer attends Q to them without a mask and returns ``(out, lse)``; the sender merges that with
  its own causal attention over the rest of the prefix by log-sum-exp;
* backward: the sender ships ``dout``, Q, the merged ``out`` and ``lse`` and the moved K/V; the
  peer returns fp32 ``dQ`` (added to the sender's) and ``dK``/``dV`` of the moved block (added
  into the sender's K/V cache accumulators).

The sender posts its receives together with its sends, before its own attention, and the peer
serves before its own, so one layer's meeting needs no third party; the readiness walk ran the
pair as one rendezvous (``drop_deadlocks``), so neither end waits for the other behind a message
it has not sent yet. Messages are tagged in their own range, above the schedule's and the
vocabulary exchange's tags, by (pair, layer, message): gloo matches them by tag, so they never
take the place of an activation on the same link. With interleaving (vpp > 1) a pair may couple
two model chunks: attention has no weights, so the peer needs only the sender's Q/K/V, and since an
action names its chunk and sits in one pair at most, two chunks' meetings never share a tag. Both
ends run one chunk's layers each, equally many (recipes split layers evenly over pp x vpp chunks).
Under query-out context parallelism each CP rank pairs with the same CP rank of the peer stage
and ships its own shards (``shards``: the CP size; ``runtime/pipeline/cp_exchange.py``). NCCL
ignores tags and matches in posting order, which activation receives posted ahead would break, so
there ``group`` must carry nothing else (``megatron/slimpipe/exchange_group.py`` makes one).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_slim.plan.schedule.exchange_blocks import ExchangePlan
from megatron_slim.plan.schedule.ir import Action

TAG_BASE = 2**30  # above the schedule's tags and the vocabulary exchange's (both far below)
_MESSAGES = 16  # message kinds per layer (forward 5, backward 9)
_TAG_SPAN = 2**30 - _MESSAGES  # every tag stays below 2**31 - 1
_LAYERS = 4096  # layer slots per pair

Tensor = torch.Tensor
Attend = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]  # (q, k, v) -> the block's (out, lse)
Gradients = Callable[..., tuple[Tensor, Tensor, Tensor]]  # (dout, q, out, lse, k, v) -> (dq, dk, dv)


def unmasked(backend, scale: float) -> tuple[Attend, Gradients]:
    """The block's forward and backward without context parallelism: plain unmasked attention."""

    def attend(q, k, v):
        return backend.forward(q, k, v, causal=False, softmax_scale=scale)

    def gradients(dout, q, out, lse, k, v):
        return backend.backward(dout, q, k, v, out, lse, causal=False, softmax_scale=scale)

    return attend, gradients


@dataclass(frozen=True)
class ExchangeRole:
    """What a paired action on this rank does at each of its attention layers."""

    sender: bool
    other: int  # pipeline rank of the pair's other end
    pair_index: int  # in the plan's order: the same on both ends
    query_rows: int  # rows of the sender's slice on this CP rank (the whole slice without CP)
    moved: int  # oldest K/V tokens of the sender's prefix the peer attends to
    moved_rows: int  # of them, the rows this CP rank holds and ships


def _refuse_beyond_pairs(plan: ExchangePlan, block) -> None:
    """This runtime meets one block per action, both ends in one pass (a mirrored pair)."""
    single = len(plan.group_of(*block.sender_end)) == 2
    if not single or block.backward != block.taker_action.kind.is_backward:
        raise NotImplementedError(
            f"context exchange: block {block} is not a same-pass pair (an action in several blocks, or a "
            "block served in the other pass); this runtime runs mirrored pairs only"
        )


def paired_role(exchange: Optional["ContextExchange"], packed: bool, recompute: bool) -> Optional[ExchangeRole]:
    """The current action's role at this layer (None: not paired); refuses packed documents.

    ``recompute``: a forward rebuilt inside a backward action (activation recomputation) is never
    paired: its attention runs over the whole cached prefix locally. The backward needs only the
    slice's merged (out, lse), which equal the paired forward's, and the forward's pair has run;
    the backward action's own pair meets in the attention backward (called with ``recompute=False``)."""
    role = exchange.role if exchange is not None else None
    if role is not None and packed:
        raise ValueError(
            "schedule.slice_policy=exchange: context exchange does not run packed documents; allowed: "
            "unpacked batches (data.packing=none), or schedule.slice_policy=uniform"
        )
    return None if recompute else role


class Pending:
    """A sender's messages of one layer in flight; ``wait`` returns what the peer sent back."""

    def __init__(self, sends: list, receives: list, buffers: tuple[torch.Tensor, ...]) -> None:
        self._sends, self._receives, self._buffers = sends, receives, buffers

    def wait(self) -> tuple[torch.Tensor, ...]:
        for work in self._receives + self._sends:
            work.wait()
        return self._buffers


class ContextExchange:
    def __init__(
        self, plan: ExchangePlan, rank: int, group, pp_ranks: Sequence[int], lengths: Sequence[int], shards: int = 1
    ) -> None:
        """``pp_ranks[i]``: the global rank of pipeline rank ``i`` in ``group``; ``lengths``: slice lengths;
        ``shards``: the CP size (each CP rank ships its shard of the slice's queries and moved K/V)."""
        self.group, self.pp_ranks, self.shards = group, list(pp_ranks), shards
        self._roles: dict[Action, ExchangeRole] = {}
        for i, p in enumerate(plan.blocks):
            _refuse_beyond_pairs(plan, p)
            rows, moved = lengths[p.sender_action.slice] // shards, p.tokens
            if p.sender == rank:
                self._roles[p.sender_action] = ExchangeRole(True, p.taker, i, rows, moved, moved // shards)
            elif p.taker == rank:
                self._roles[p.taker_action] = ExchangeRole(False, p.sender, i, rows, moved, moved // shards)
        self._current: Optional[ExchangeRole] = None
        self._action: Optional[Action] = None
        self._layer = 0
        self.sent_tokens = 0  # K/V rows this rank moved to peers (its CP shard), summed over layers and passes
        self.served_blocks = 0  # attention blocks this rank computed for senders

    @property
    def role(self) -> Optional[ExchangeRole]:
        """The current action's role, None outside a paired action."""
        return self._current

    @contextmanager
    def scope(self, action: Action) -> Iterator[None]:
        """Run ``action``: its attention layers meet its partner's, if it is paired."""
        self._current, self._action, self._layer = self._roles.get(action), action, 0
        try:
            yield
            if self._current is not None and self._layer == 0:
                raise RuntimeError(f"context exchange: paired action {action} ran no attention layer")
        finally:
            self._current, self._action = None, None

    def moved_chunks(self, chunk_lengths: Sequence[int]) -> int:
        """How many of the oldest cached chunks (``chunk_lengths`` local rows each) the pair moves."""
        role, total = self._role(), 0
        for count, length in enumerate(chunk_lengths, start=1):
            total += length * self.shards
            if total == role.moved:
                return count
        raise RuntimeError(
            f"context exchange: {self._action} moves {role.moved} tokens, not a whole number of its "
            f"cached slices ({list(chunk_lengths)})"
        )

    # ---- the sender ---------------------------------------------------------------------------
    def send_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Pending:
        """Ship Q and the moved K/V; ``wait()`` -> the block's (out, lse)."""
        role, tag = self._role(), self._next_layer()
        b, s, hq, _ = q.shape
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty(b, hq, s, dtype=torch.float32, device=q.device)
        self.sent_tokens += role.moved_rows
        return self._exchange(role, tag, (q, k, v), (out, lse))

    def send_backward(self, dout, q, out, lse, k, v) -> Pending:
        """Ship what the block's backward needs; ``wait()`` -> fp32 (dQ, dK, dV) of the block."""
        role, tag = self._role(), self._next_layer()
        grads = (torch.empty(q.shape, dtype=torch.float32, device=q.device),) + tuple(
            torch.empty(t.shape, dtype=torch.float32, device=t.device) for t in (k, v)
        )
        self.sent_tokens += role.moved_rows
        return self._exchange(role, tag, (dout, q, out, lse, k, v), grads)

    def _exchange(self, role: ExchangeRole, tag: int, payload: tuple, buffers: tuple) -> Pending:
        other = self.pp_ranks[role.other]
        sends = [dist.isend(t.detach().contiguous(), other, self.group, tag + i) for i, t in enumerate(payload)]
        first = tag + len(payload)
        receives = [dist.irecv(t, other, self.group, first + i) for i, t in enumerate(buffers)]
        return Pending(sends, receives, buffers)

    # ---- the peer -----------------------------------------------------------------------------
    def serve_forward(self, q_like: Tensor, kv_like: Tensor, attend: Attend) -> None:
        """Attend the sender's Q to its moved K/V, unmasked (``attend``), and return (out, lse)."""
        role, tag = self._role(), self._next_layer()
        kv_shape = self._kv_shape(role, kv_like)
        q, k, v = self._receive(role, tag, (self._q_shape(role, q_like), kv_shape, kv_shape), q_like)
        out, lse = attend(q, k, v)
        self._reply(role, tag + 3, (out, lse.float()))

    def serve_backward(self, q_like: Tensor, kv_like: Tensor, gradients: Gradients) -> None:
        """The block's backward for the sender (``gradients``): fp32 (dQ, dK, dV) go back."""
        role, tag = self._role(), self._next_layer()
        q_shape, kv_shape = self._q_shape(role, q_like), self._kv_shape(role, kv_like)
        b, s, hq, _ = q_shape
        shapes = (q_shape, q_shape, q_shape, (b, hq, s), kv_shape, kv_shape)
        dout, q, out, lse, k, v = self._receive(role, tag, shapes, q_like, lse_at=3)
        dq, dk, dv = gradients(dout, q, out, lse, k, v)
        self._reply(role, tag + 6, (dq.float(), dk.float(), dv.float()))

    def _receive(self, role, tag: int, shapes, like: torch.Tensor, lse_at: int = -1) -> list[torch.Tensor]:
        other, got = self.pp_ranks[role.other], []
        for i, shape in enumerate(shapes):
            dtype = torch.float32 if i == lse_at else like.dtype
            buffer = torch.empty(tuple(shape), dtype=dtype, device=like.device)
            dist.recv(buffer, other, self.group, tag + i)
            got.append(buffer)
        self.served_blocks += 1
        return got

    def _reply(self, role: ExchangeRole, tag: int, tensors: tuple) -> None:
        other = self.pp_ranks[role.other]
        works = [dist.isend(t.detach().contiguous(), other, self.group, tag + i) for i, t in enumerate(tensors)]
        for work in works:  # the sender posted these receives with its sends
            assert work is not None  # None only for a rank outside the group
            work.wait()

    @staticmethod
    def _q_shape(role: ExchangeRole, q_like: torch.Tensor) -> tuple[int, ...]:
        b, _, hq, d = q_like.shape
        return (b, role.query_rows, hq, d)

    @staticmethod
    def _kv_shape(role: ExchangeRole, kv_like: torch.Tensor) -> tuple[int, ...]:
        b, _, hkv, d = kv_like.shape
        return (b, role.moved_rows, hkv, d)

    # ---- bookkeeping --------------------------------------------------------------------------
    def _role(self) -> ExchangeRole:
        if self._current is None:
            raise RuntimeError("context exchange: no paired action is running")
        return self._current

    def _next_layer(self) -> int:
        """The first tag of the current layer's messages; moves on to the next layer."""
        role = self._role()
        tag = TAG_BASE + ((role.pair_index * _LAYERS + self._layer) * _MESSAGES) % _TAG_SPAN
        self._layer += 1
        return tag
