"""A zigzag ring: K/V blocks travel one member per step; dK/dV travel with them in the backward.

Member ``i`` computes its queries against the block of member ``i - s`` at step ``s`` (step 0 is
its own block, the only causal one; ``block_attention`` works out which key chunks each query
chunk sees, so chunk sizes need not be equal and lengths need not divide by ``2g``).

Forward: post step 1, then every step waits for its block, forwards it to the next member (step
``s + 1``) and computes, folding partials by log-sum-exp. Backward: the K/V blocks make the same
trip; member ``i`` adds its share of the block's dK/dV to the buffer that arrived with it and
passes it on; after ``g - 1`` steps each buffer holds every member's share and one last hop
(step ``g``) takes it home. Hop ``j`` of every step goes ``members[j-1] -> members[j]``; inter-node
hops are relayed as the ``RoutingPlan`` says for ``(group, step, destination)``, K/V and dK/dV alike.

The generators yield at round boundaries (see ``engine.run_queues``); a rank that only relays
for this ring (``me is None``) runs the same code without data or compute, so it posts at exactly
the same rounds as the members.
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron_slim.plan.cp.routing import RoutePart, RoutingPlan
from megatron_slim.runtime.cp.block_attention import backward_into, forward_into, new_accumulators, pair_calls
from megatron_slim.runtime.cp.exchange import Exchange, Hop
from megatron_slim.runtime.cp.run_context import RunContext, pack, unpack
from megatron_slim.runtime.cp.spans import Block, block_rows

Tensor = torch.Tensor


def route_parts(routing: Optional[RoutingPlan], group: int, step: int, src: int, dst: int,
                rows: int) -> tuple[RoutePart, ...]:
    """The routed parts of one hop, or () to send it directly."""
    if routing is None or src == dst:
        return ()
    route = routing.route_for(group, step, dst)
    if route is None or not route.routed:
        return ()
    if route.src != src or route.size != rows:
        raise ValueError(f"routing plan: group {group} step {step} hop to {dst} is {route.src}->{route.dst} with "
                         f"{route.size} rows, but the CP plan sends {rows} rows from {src}: the routing plan was "
                         "made for another plan")
    return route.parts


def ring_exchange(name: str, group: int, members: tuple[int, ...], blocks: tuple[Block, ...], step: int,
                  width: int, routing: Optional[RoutingPlan]) -> Exchange:
    g = len(members)
    hops = []
    for j in range(g):
        src, dst = members[j - 1], members[j]
        rows = block_rows(blocks[(j - step) % g])
        hops.append(Hop(src, dst, rows, width, route_parts(routing, group, step, src, dst, rows)))
    return Exchange(f"{name} of group {group}, step {step}", tuple(hops))


class Ring:
    def __init__(self, group: int, members: tuple[int, ...], blocks: tuple[Block, ...], me: Optional[int],
                 kv_heads: int, d: int, dv: int, routing: Optional[RoutingPlan]) -> None:
        self.group, self.members, self.blocks, self.me = group, members, blocks, me
        self.kv_shapes = ((kv_heads, d), (kv_heads, dv))
        g = len(members)
        width = kv_heads * (d + dv)
        self.kv = {s: ring_exchange("K/V", group, members, blocks, s, width, routing) for s in range(1, g)}
        self.dkv = {s: ring_exchange("dK/dV", group, members, blocks, s, width, routing) for s in range(1, g + 1)} \
            if g > 1 else {}
        self.calls = {s: pair_calls(blocks[me], blocks[(me - s) % g], own=s == 0) for s in range(g)} \
            if me is not None else {}

    @property
    def size(self) -> int:
        return len(self.members)

    def involves(self, rank: int) -> bool:
        return any(x.involves(rank) for x in (*self.kv.values(), *self.dkv.values()))

    def _post(self, rt: RunContext, table: dict, step: int, payload: Optional[Tensor], dtype: torch.dtype):
        sends = {} if self.me is None else {(self.me + 1) % self.size: payload}
        return table[step].post(rt.comm, sends, dtype=dtype, device=rt.device)

    def _block(self, message: Tensor) -> tuple[Tensor, Tensor]:
        k, v = unpack(message, *self.kv_shapes)
        return k.contiguous(), v.contiguous()

    def forward(self, rt: RunContext, q: Optional[Tensor], k: Optional[Tensor], v: Optional[Tensor]):
        """Generator; returns ``(out, lse)`` (``None`` on a relay-only rank)."""
        g, me = self.size, self.me
        if me is not None:
            acc_out, acc_lse = new_accumulators(q.shape[0], q.shape[1], v.shape[2], q)
        pending = self._post(rt, self.kv, 1, None if me is None else pack(k, v), rt.dtype) if g > 1 else None
        yield  # every group's first transfer is in flight before any group computes
        if me is not None:
            forward_into(rt.backend, rt.scale, self.calls[0], q, k, v, acc_out, acc_lse)
        for s in range(1, g):
            yield
            block = pending.wait().get(me)
            if s + 1 < g:
                pending = self._post(rt, self.kv, s + 1, block, rt.dtype)
            if me is not None:
                forward_into(rt.backend, rt.scale, self.calls[s], q, *self._block(block), acc_out, acc_lse)
        if me is None:
            return None
        return acc_out.to(rt.dtype), acc_lse

    def backward(self, rt: RunContext, dout: Optional[Tensor], saved):
        """Generator; returns ``(dq, dk, dv)`` in the accumulation dtype (``None`` when relay-only)."""
        g, me = self.size, self.me
        acc = rt.acc_dtype
        if me is not None:
            q, k, v, out, lse = saved
            dq, dk, dv = (torch.zeros(t.shape, dtype=acc, device=t.device) for t in (q, k, v))
        kv_pending = self._post(rt, self.kv, 1, None if me is None else pack(k, v), rt.dtype) if g > 1 else None
        yield
        dkv = None
        if me is not None:
            backward_into(rt.backend, rt.scale, self.calls[0], dout, q, k, v, out, lse, dq, dk, dv)
            if g == 1:
                return dq, dk, dv
            dkv = pack(dk, dv)
        for s in range(1, g):
            yield
            block = kv_pending.wait().get(me)
            if s + 1 < g:
                kv_pending = self._post(rt, self.kv, s + 1, block, rt.dtype)
            # The buffer of block i - s, holding the shares of members i - s .. i - 1.
            dkv = self._post(rt, self.dkv, s, dkv, acc).wait().get(me)
            if me is not None:
                dk_b, dv_b = unpack(dkv, *self.kv_shapes)  # views: accumulate in place
                backward_into(rt.backend, rt.scale, self.calls[s], dout, q, *self._block(block), out, lse,
                              dq, dk_b, dv_b)
        if g > 1:
            yield
            dkv = self._post(rt, self.dkv, g, dkv, acc).wait().get(me)  # home: every member's share
        if me is None:
            return None
        dk, dv = unpack(dkv, *self.kv_shapes)
        return dq, dk, dv
