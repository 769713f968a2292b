"""A context-exchange sender under query-out context parallelism (:mod:`cp_slice_attention`, zigzag shards).

Each CP rank caches its zigzag shard of every earlier slice: cached slice ``i`` (``L_i`` tokens,
starting at token ``o_i`` of the prefix) holds the tokens ``o_i + layout_i.positions(rank)``. A
block covers the prefix tokens ``[kv_start, kv_end)``, which need not align with cached slices or
zigzag chunks, so each CP rank selects *its* rows of the range by position (its count differs per
rank, and may be zero) and ships them with its query rows to the CP rank of the same index on the
taker stage (``exchange_cp_server.py`` computes the block there). So the pipeline link carries 1/cp
of the slice's Q and about 1/cp of the moved K/V per CP rank, as ``plan/cost/exchange.py`` prices it.

Its own query-out attention then runs over its rows at positions ``>= m`` (the blocks cover
``[0, m)``) plus the slice, as without exchange; the blocks' (out, lse) merge into its combined rows
by log-sum-exp (forward). Backward: the blocks' fp32 dQ add to the reduce-scattered dQ; their dK/dV,
and those of its kept rows, go back into exactly their rows of each cached slice's accumulator.
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional, Sequence

import torch

from megatron_slim.runtime.attention import merge_
from megatron_slim.runtime.pipeline.context_exchange import ContextExchange, paired_role
from megatron_slim.runtime.pipeline.exchange_wire import Pending
from megatron_slim.runtime.pipeline.zigzag import ZigzagLayout

Tensor = torch.Tensor
Prefix = Sequence[tuple[Tensor, Tensor]]
Accumulate = Callable[[int, Tensor, Tensor], None]  # (cached slice, dk, dv) into its accumulator


def prefix_positions(prefix: Prefix, cp: int, rank: int) -> list[Tensor]:
    """Per cached slice, the prefix token positions of this CP rank's rows, in local order."""
    offset, positions = 0, []
    for k_i, _ in prefix:
        length = k_i.shape[1] * cp
        positions.append(offset + ZigzagLayout(cp, length).positions(rank).to(k_i.device))
        offset += length
    return positions


def _within(positions: list[Tensor], start: int, end: int) -> list[Tensor]:
    return [torch.nonzero((p >= start) & (p < end)).flatten() for p in positions]


class Opened:
    """One layer's exchange on a CP rank: which cached rows stay, what was shipped, what comes back.
    Not a sender (``kept`` None): every cached row stays, nothing comes back."""

    def __init__(
        self,
        prefix: Prefix,
        kept: Optional[list[Tensor]] = None,
        blocks: Sequence[list[Tensor]] = (),
        pending: Sequence[Pending] = (),
    ) -> None:
        self.prefix, self._kept, self._blocks, self._pending = prefix, kept, list(blocks), list(pending)
        self._grads: dict[int, tuple[Tensor, Tensor]] = {}

    def kept(self) -> Iterator[tuple[int, Tensor, Tensor]]:
        """``(cached slice, its K rows, its V rows)`` this rank attends to itself (none empty)."""
        for i, (k_i, v_i) in enumerate(self.prefix):
            if self._kept is None:
                yield i, k_i, v_i
            elif self._kept[i].numel():
                yield i, k_i.index_select(1, self._kept[i]), v_i.index_select(1, self._kept[i])

    def close_forward(self, out: Tensor, lse: Tensor) -> None:
        """Merge every block's (out, lse) into this rank's combined rows."""
        for work in self._pending:
            merge_(out, lse, *work.wait())

    def accumulate(self, i: int, dk: Tensor, dv: Tensor, into: Accumulate) -> None:
        """dK/dV of :meth:`kept`'s rows of cached slice ``i``."""
        if self._kept is None:
            into(i, dk, dv)
        else:
            self._add(i, self._kept[i], dk, dv)

    def close_backward(self, into: Accumulate):
        """The blocks' dK/dV into their rows, every touched slice's gradient into ``into``; the blocks' fp32 dQ."""
        dq: Tensor | int = 0
        for rows, work in zip(self._blocks, self._pending, strict=True):
            dq_block, dk, dv = work.wait()
            start = 0
            for i, idx in enumerate(rows):
                n = idx.numel()
                self._add(i, idx, dk[:, start : start + n], dv[:, start : start + n])
                start += n
            dq = dq + dq_block
        for i, (gk, gv) in sorted(self._grads.items()):
            into(i, gk, gv)
        return dq

    def _add(self, i: int, idx: Tensor, dk: Tensor, dv: Tensor) -> None:
        if idx.numel() == 0:
            return
        if i not in self._grads:
            k_i = self.prefix[i][0]
            self._grads[i] = (
                torch.zeros(k_i.shape, dtype=torch.float32, device=k_i.device),
                torch.zeros(self.prefix[i][1].shape, dtype=torch.float32, device=k_i.device),
            )
        gk, gv = self._grads[i]
        gk.index_add_(1, idx, dk.float())
        gv.index_add_(1, idx, dv.float())


def _select(prefix: Prefix, exchange: ContextExchange, rank: int) -> tuple[list[Tensor], list[list[Tensor]], list]:
    """This rank's kept rows per cached slice, each block's rows per cached slice, each block's (K, V) rows."""
    role = exchange.current_role()
    positions = prefix_positions(prefix, exchange.shards, rank)
    blocks = [_within(positions, b.kv_start, b.kv_end) for b in role.blocks]
    kvs = [
        tuple(torch.cat([t.index_select(1, idx) for (t, idx) in zip(side, rows)], dim=1) for side in zip(*prefix))
        for rows in blocks
    ]
    return _within(positions, role.moved, 2**62), blocks, kvs


def open_forward(exchange: Optional[ContextExchange], setup, q: Tensor, prefix: Prefix, recompute: bool) -> Opened:
    """A sender's first step at one layer: ship its query rows and each block's K/V rows."""
    if exchange is None or paired_role(exchange, setup.documents is not None, recompute) is None:
        return Opened(prefix)
    kept, blocks, kvs = _select(prefix, exchange, setup.rank)
    return Opened(prefix, kept, blocks, exchange.ship_forward(q, kvs, setup.scale))


def open_backward(exchange: Optional[ContextExchange], setup, dout, q, out, lse, prefix: Prefix) -> Opened:
    """:func:`open_forward` for the backward: the sender ships (dout, q, out, lse) and each block's rows."""
    if exchange is None or paired_role(exchange, setup.documents is not None, False) is None:
        return Opened(prefix)
    kept, blocks, kvs = _select(prefix, exchange, setup.rank)
    return Opened(prefix, kept, blocks, exchange.ship_backward(dout, q, out, lse, kvs, setup.scale))
