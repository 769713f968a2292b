"""Context exchange at run time: this rank's side of the schedule's blocks (``Schedule.exchange``).

A block couples a compute action of a *sender* with one of a *taker* on another rank
(``plan/schedule/exchange_blocks.py``): the taker attends the sender's slice to the token range
``[kv_start, kv_end)`` of the sender's K/V prefix, unmasked (it precedes the slice). A sender's
blocks cover ``[0, m)``; it runs its own causal attention over ``[m, prefix)`` plus the slice. Both
ends' actions run chunks of equally many layers (recipes split layers evenly over pp x vpp chunks),
and the sender's ``j``-th attention layer meets each of its blocks' ``j``-th service:

* forward: the sender ships its slice's Q and each block's K/V rows; each taker returns
  ``(out, lse)``; the sender merges them with its own by log-sum-exp;
* backward: the sender ships ``dout``, Q, the merged ``out`` and ``lse`` and each block's K/V rows;
  each taker returns fp32 ``dQ`` (summed into the sender's) and ``dK``/``dV`` of its rows (added into
  the sender's K/V cache accumulators, rows that need not align with cached slices).

A taker's blocks, of either pass, are served beside its own layers by a server started when the
taker's action begins and joined when it ends; the taker's own attention runs as without exchange.
Without CP (``shards == 1``) a :class:`BlockServer` (``exchange_server.py``) serves each block as
soon as its bytes arrive. Under query-out context parallelism (``shards``: the CP size) each CP
rank of the sender stage ships its query shard and its own rows of each block's K/V range
(``cp_exchange.py``: ranges need not align with cached slices or zigzag chunks) to the CP rank of
the same index on the taker stage, whose CP ranks compute the block together on ``cp_group``; a
:class:`CPBlockServer` (``exchange_cp_server.py``) serves them in one thread, in plan order. The
sender posts its receives with its sends, before its own attention. The readiness walk ran the
actions linked by blocks as one rendezvous (``drop_deadlocks``), so no end waits behind a message
not yet sent.

Messages are tagged by (block, layer, message) in their own range (``exchange_wire.py``). With
interleaving a block may couple two model chunks: attention has no weights. NCCL ignores tags and
matches in posting order, so there ``group`` must carry nothing else
(``megatron/slimpipe/exchange_group.py`` makes one).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_slim.plan.schedule.exchange_blocks import ExchangePlan
from megatron_slim.plan.schedule.ir import Action
from megatron_slim.runtime.attention import AttentionBackend
from megatron_slim.runtime.pipeline.exchange_cp_server import CPBlockServer
from megatron_slim.runtime.pipeline.exchange_server import BlockServer, ServedBlock
from megatron_slim.runtime.pipeline.exchange_wire import Header, Pending, done_header, layer_tag, post, wait_all

Tensor = torch.Tensor
KV = tuple[Tensor, Tensor]


@dataclass(frozen=True)
class BlockEnd:
    """One block as one of its ends sees it."""

    index: int  # in the plan's order: the same on both ends
    other: int  # pipeline rank of the block's other end
    kv_start: int  # the block's K/V tokens in the sender's prefix: [kv_start, kv_end)
    kv_end: int
    backward: bool  # the block's pass (its sender's)

    @property
    def tokens(self) -> int:
        return self.kv_end - self.kv_start


@dataclass(frozen=True)
class ExchangeRole:
    """What an exchanging action on this rank does at each of its attention layers."""

    sender: bool
    blocks: tuple[BlockEnd, ...]  # a sender's, or a taker's served blocks, in plan order

    @property
    def other(self) -> int:
        """The pipeline rank of the first block's other end."""
        return self.blocks[0].other

    @property
    def moved(self) -> int:
        """K/V tokens of the sender's prefix the blocks cover (a sender's ``m``)."""
        return sum(b.tokens for b in self.blocks)


def _role(sender: bool, items: list) -> ExchangeRole:
    ends = (BlockEnd(i, b.taker if sender else b.sender, b.kv_start, b.kv_end, b.backward) for i, b in items)
    return ExchangeRole(sender, tuple(ends))


def paired_role(exchange: Optional["ContextExchange"], packed: bool, recompute: bool) -> Optional[ExchangeRole]:
    """What the current action's attention does at this layer (None: nothing exchanged); refuses
    packed documents. A taker without CP gets None: its server serves its blocks.

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
    if role is None or recompute:
        return None
    return role if role.sender else None  # a taker's blocks are served beside its layers; its attention is its own


class ContextExchange:
    def __init__(
        self,
        plan: ExchangePlan,
        rank: int,
        group,
        pp_ranks: Sequence[int],
        shards: int = 1,
        device: Optional[torch.device] = None,
        cp_group=None,
    ) -> None:
        """``pp_ranks[i]``: the global rank of pipeline rank ``i`` in ``group``; ``shards``: the CP size
        (each CP rank ships its own rows); ``device``: where the served blocks' buffers go (default
        CPU); ``cp_group``: the exchange's own group over this stage's CP ranks (``shards > 1``)."""
        self.group, self.pp_ranks, self.shards, self.cp_group = group, list(pp_ranks), shards, cp_group
        self.device = device if device is not None else torch.device("cpu")
        self.backend: Optional[AttentionBackend] = None  # recorded by this rank's attention layers; serving uses it
        sent: dict[Action, list] = {}
        served: dict[Action, list] = {}
        for i, b in enumerate(plan.blocks):
            if b.sender == rank:
                sent.setdefault(b.sender_action, []).append((i, b))
            elif b.taker == rank:
                served.setdefault(b.taker_action, []).append((i, b))
        self._roles = {a: _role(True, items) for a, items in sent.items()}
        self._roles.update({a: _role(False, items) for a, items in served.items()})
        self._current: Optional[ExchangeRole] = None
        self._action: Optional[Action] = None
        self._layer = 0
        self.sent_tokens = 0  # K/V rows this rank moved to peers (its CP shard), summed over layers and passes
        self.served_blocks = 0  # attention blocks this rank computed for senders (one per layer), after drain()
        self._servers: list[BlockServer] = []  # started, not yet drained

    @property
    def role(self) -> Optional[ExchangeRole]:
        """The current action's role, None outside an exchanging action."""
        return self._current

    @contextmanager
    def scope(self, action: Action) -> Iterator[None]:
        """Run ``action``: its attention layers meet its blocks' other ends, if it exchanges."""
        self._current, self._action, self._layer = self._roles.get(action), action, 0
        server = self._start_server(self._current)
        try:
            yield
            self._finish(action, server)
        finally:
            self._current, self._action = None, None

    def _start_server(self, role: Optional[ExchangeRole]) -> Optional[BlockServer]:
        if role is None or role.sender:
            return None
        blocks = [ServedBlock(b.index, self.pp_ranks[b.other], b.backward) for b in role.blocks]
        if self.shards == 1:
            server = BlockServer(blocks, self.group, self.device, self._backend_for)
        elif self.cp_group is None:
            raise ValueError(f"context exchange under cp={self.shards}: a taker needs cp_group (its stage's CP group)")
        else:
            previous = next((s for s in reversed(self._servers) if isinstance(s, CPBlockServer)), None)
            server = CPBlockServer(blocks, self.group, self.device, self._backend_for, self.cp_group, previous)
        server.start()
        self._servers.append(server)
        return server

    def drain(self) -> None:
        """Wait for every taker server this rank started (its senders' actions have all run by the
        end of a schedule); count what they served and raise the first error. A taker's action does
        not wait for its server: its own next action may start while its last block is served, as the
        simulator prices it (``plan/sim/engine.py``)."""
        servers, self._servers = self._servers, []
        for server in servers:
            self.served_blocks += server.join()

    def _backend_for(self, head: Header):
        if self.backend is not None:
            return self.backend
        from megatron_slim.runtime.attention import select_backend

        return select_backend(None, self.device, head.dtype)

    def _finish(self, action: Action, server: Optional[BlockServer]) -> None:
        """A sender tells its takers it is done; a taker's server runs on (``drain``)."""
        role = self._current
        if role is None or server is not None:
            return
        if self._layer == 0:
            raise RuntimeError(f"context exchange: exchanging action {action} ran no attention layer")
        done = done_header(self.device)
        ends = [(self.pp_ranks[b.other], layer_tag(b.index, self._layer)) for b in role.blocks]
        wait_all([dist.isend(done, other, self.group, tag) for other, tag in ends])

    # ---- a sender: several blocks, any token ranges ---------------------------------------------
    def ship_forward(self, q: Tensor, kvs: Sequence[KV], scale: float) -> list[Pending]:
        """Ship Q and each block's K/V rows (``kvs[i]``: the rows of block ``i`` this rank holds);
        each ``wait()`` -> that block's (out, lse)."""
        role, layer = self._role(), self._next_layer_index()
        b, s, hq, _ = q.shape
        pending = []
        for block, (k, v) in zip(role.blocks, kvs, strict=True):
            buffers = (q.new_empty(q.shape), torch.empty(b, hq, s, dtype=torch.float32, device=q.device))
            pending.append(self._ship(block, layer, Header.of(q, k, scale), (q, k, v), buffers))
        return pending

    def ship_backward(self, dout, q, out, lse, kvs: Sequence[KV], scale: float) -> list[Pending]:
        """Ship what each block's backward needs; each ``wait()`` -> fp32 (dQ, dK, dV) of that block."""
        role, layer = self._role(), self._next_layer_index()
        pending = []
        for block, (k, v) in zip(role.blocks, kvs, strict=True):
            grads = tuple(torch.empty(t.shape, dtype=torch.float32, device=t.device) for t in (q, k, v))
            pending.append(self._ship(block, layer, Header.of(q, k, scale), (dout, q, out, lse, k, v), grads))
        return pending

    def _ship(self, block: BlockEnd, layer: int, head: Header, payload: tuple, buffers: tuple) -> Pending:
        other, tag = self.pp_ranks[block.other], layer_tag(block.index, layer)
        sends = [dist.isend(head.encode(self.device), other, self.group, tag)]
        sends += post(dist.isend, [t.detach().contiguous() for t in payload], other, self.group, tag + 1)
        receives = post(dist.irecv, buffers, other, self.group, tag + 1 + len(payload))
        self.sent_tokens += head.kv_rows
        return Pending(sends, receives, buffers)

    # ---- bookkeeping --------------------------------------------------------------------------
    def current_role(self) -> ExchangeRole:
        """The running action's role; refuses outside an exchanging action."""
        return self._role()

    def _role(self) -> ExchangeRole:
        if self._current is None:
            raise RuntimeError("context exchange: no exchanging action is running")
        return self._current

    def _next_layer_index(self) -> int:
        self._layer += 1
        return self._layer - 1
