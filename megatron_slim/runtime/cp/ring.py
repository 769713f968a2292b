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

The order of posts, waits, computes and rounds is not decided here: ``Ring.run`` walks the ring's
steps of the rank's program (``plan.cp.program``), the same steps the simulator prices, and yields
at each ``ROUND`` (see ``engine.run_queues``); a rank that only relays for this ring
(``me is None``) has the same steps without the computes, so it posts at exactly the same rounds.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from megatron_slim.plan.cp.program import GroupTask
from megatron_slim.plan.cp.routing import RoutePart, RoutingPlan
from megatron_slim.runtime.cp.block_attention import backward_into, forward_into, new_accumulators, pair_calls
from megatron_slim.runtime.cp.exchange import Exchange, Hop
from megatron_slim.runtime.cp.run_context import RunContext, pack, unpack, walk_steps
from megatron_slim.runtime.cp.spans import Block, block_rows

Tensor = torch.Tensor


def route_parts(
    routing: Optional[RoutingPlan], group: int, step: int, src: int, dst: int, rows: int
) -> tuple[RoutePart, ...]:
    """The routed parts of one hop, or () to send it directly."""
    if routing is None or src == dst:
        return ()
    route = routing.route_for(group, step, dst)
    if route is None or not route.routed:
        return ()
    if route.src != src or route.size != rows:
        raise ValueError(
            f"routing plan: group {group} step {step} hop to {dst} is {route.src}->{route.dst} with "
            f"{route.size} rows, but the CP plan sends {rows} rows from {src}: the routing plan was "
            "made for another plan"
        )
    return route.parts


def ring_exchange(
    name: str,
    group: int,
    members: tuple[int, ...],
    blocks: tuple[Block, ...],
    step: int,
    width: int,
    routing: Optional[RoutingPlan],
) -> Exchange:
    g = len(members)
    hops = []
    for j in range(g):
        src, dst = members[j - 1], members[j]
        rows = block_rows(blocks[(j - step) % g])
        hops.append(Hop(src, dst, rows, width, route_parts(routing, group, step, src, dst, rows)))
    return Exchange(f"{name} of group {group}, step {step}", tuple(hops))


class Ring:
    def __init__(
        self,
        group: int,
        members: tuple[int, ...],
        blocks: tuple[Block, ...],
        me: Optional[int],
        kv_heads: int,
        d: int,
        dv: int,
        routing: Optional[RoutingPlan],
    ) -> None:
        self.group, self.members, self.blocks, self.me = group, members, blocks, me
        self.kv_shapes = ((kv_heads, d), (kv_heads, dv))
        g = len(members)
        width = kv_heads * (d + dv)
        self.kv = {s: ring_exchange("K/V", group, members, blocks, s, width, routing) for s in range(1, g)}
        self.dkv = (
            {s: ring_exchange("dK/dV", group, members, blocks, s, width, routing) for s in range(1, g + 1)}
            if g > 1
            else {}
        )
        self.calls = (
            {s: pair_calls(blocks[me], blocks[(me - s) % g], own=s == 0) for s in range(g)} if me is not None else {}
        )

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

    # ---- step handlers: the ring's steps of ``plan.cp.program`` ------------------------------------
    def start_forward(self, rt: RunContext, q: Optional[Tensor], k: Optional[Tensor], v: Optional[Tensor]) -> dict:
        st: dict[str, Any] = {"rt": rt, "q": q, "k": k, "v": v, "pending": {}, "block": {}, "dtype": {"KV": rt.dtype}}
        if self.me is not None:
            assert q is not None and v is not None, "a ring member computes: it has q, k, v"
            st["acc"] = new_accumulators(q.shape[0], q.shape[1], v.shape[2], q)
        return st

    def start_backward(self, rt: RunContext, dout: Optional[Tensor], saved) -> dict:
        st: dict[str, Any] = {
            "rt": rt,
            "dout": dout,
            "pending": {},
            "block": {},
            "dkv": None,
            "dtype": {"KV": rt.dtype, "DKV": rt.acc_dtype},
        }
        if self.me is not None:
            st["q"], st["k"], st["v"], st["out"], st["lse"] = saved
            st["grads"] = [torch.zeros(t.shape, dtype=rt.acc_dtype, device=t.device) for t in saved[:3]]
        return st

    def _payload(self, st: dict, what: str, s: int) -> Optional[Tensor]:
        if what == "DKV":
            return st["dkv"]  # the buffer of block i - s + 1 (step g: every member's share)
        if s == 1:
            return None if self.me is None else pack(st["k"], st["v"])
        return st["block"][s - 1]  # pass on the block received at step s - 1

    def run_step(self, st: dict, step, backward: bool) -> None:
        """One POST, WAIT or C step of this ring (``ROUND`` is the caller's yield)."""
        s, rt = step.step, st["rt"]
        if step.op == "POST":
            table = self.kv if step.what == "KV" else self.dkv
            st["pending"][(step.what, s)] = self._post(
                rt, table, s, self._payload(st, step.what, s), st["dtype"][step.what]
            )
        elif step.op == "WAIT":
            got = st["pending"].pop((step.what, s)).wait().get(self.me)
            if step.what == "KV":
                st["block"][s] = got
            else:
                st["dkv"] = got
        elif backward:
            self._compute_backward(st, s)
        else:
            k, v = (st["k"], st["v"]) if s == 0 else self._block(st["block"][s])
            forward_into(rt.backend, rt.scale, self.calls[s], st["q"], k, v, *st["acc"])

    def _compute_backward(self, st: dict, s: int) -> None:
        rt = st["rt"]
        dq, dk, dv = st["grads"]
        if s == 0:
            backward_into(
                rt.backend,
                rt.scale,
                self.calls[0],
                st["dout"],
                st["q"],
                st["k"],
                st["v"],
                st["out"],
                st["lse"],
                dq,
                dk,
                dv,
            )
            if self.size > 1:
                st["dkv"] = pack(dk, dv)
            return
        dk_b, dv_b = unpack(st["dkv"], *self.kv_shapes)  # views: accumulate in place
        backward_into(
            rt.backend,
            rt.scale,
            self.calls[s],
            st["dout"],
            st["q"],
            *self._block(st["block"][s]),
            st["out"],
            st["lse"],
            dq,
            dk_b,
            dv_b,
        )

    def finish_forward(self, st: dict):
        """``(out, lse)`` (``None`` on a relay-only rank)."""
        if self.me is None:
            return None
        acc_out, acc_lse = st["acc"]
        return acc_out.to(st["rt"].dtype), acc_lse

    def finish_backward(self, st: dict):
        """``(dq, dk, dv)`` in the accumulation dtype (``None`` when relay-only)."""
        if self.me is None:
            return None
        if self.size == 1:
            return tuple(st["grads"])
        dk, dv = unpack(st["dkv"], *self.kv_shapes)  # home: every member's share
        return st["grads"][0], dk, dv

    def run(self, task: GroupTask, steps, rt: RunContext, *args, backward: bool):
        """Generator over this ring's ``steps`` of ``task``; returns ``finish_forward`` / ``finish_backward``."""
        st = self.start_backward(rt, *args) if backward else self.start_forward(rt, *args)
        yield from walk_steps(task, steps, rt, lambda step: self.run_step(st, step, backward))
        return self.finish_backward(st) if backward else self.finish_forward(st)
