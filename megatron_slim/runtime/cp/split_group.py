"""local, zigzag, ulysses and hierarchical groups: one shape, "all-to-all in the node, ring across".

A group of ``n`` nodes x ``a`` ranks (``a = a2a_size``):

* ``a > 1``: an all-to-all among the node's members turns "my tokens, all heads" into "all of the
  node's tokens, my share of the heads" (``heads.split_heads``); the node's tokens are its
  members' blocks one after another, which every rank can list from the plan.
* a ring over the ``n`` nodes, one per local index (``ring.Ring``), on those node blocks;
* ``a > 1``: the all-to-all back gives every member its own tokens with all heads.

``local`` is ``n = a = 1``, ``zigzag`` ``a = 1``, ``ulysses`` ``n = 1``, ``hierarchical`` both > 1.
The backward runs the same in reverse (dO in, dQ/dK/dV out; replicated K/V heads sum their dK/dV).
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_slim.plan.cp.layout import CPGroup, CPPlan
from megatron_slim.plan.cp.program import GroupTask
from megatron_slim.plan.cp.routing import RoutingPlan
from megatron_slim.runtime.cp.block_attention import Rows
from megatron_slim.runtime.cp.exchange import Exchange, Hop
from megatron_slim.runtime.cp.heads import split_heads
from megatron_slim.runtime.cp.ring import Ring
from megatron_slim.runtime.cp.run_context import HeadShape, RunContext, flat2d, pack, unpack, walk_steps
from megatron_slim.runtime.cp.spans import block_rows, concat, group_rows, member_block

Tensor = torch.Tensor


def _a2a(name: str, node: tuple[int, ...], rows: list[int], width, *, to_owner: bool) -> Exchange:
    """Hop ``j * a + m`` goes node member ``j -> m``. ``to_owner=False``: ``j`` sends its ``rows[j]``
    tokens (width by receiver ``m``); ``True``: ``j`` sends ``m``'s ``rows[m]`` tokens (width by sender)."""
    a = len(node)
    hops = [
        Hop(node[j], node[m], rows[m] if to_owner else rows[j], width(j) if to_owner else width(m))
        for j in range(a)
        for m in range(a)
    ]
    return Exchange(name, tuple(hops))


class SplitGroupTask:
    def __init__(
        self,
        plan: CPPlan,
        group: CPGroup,
        rank: int,
        shape: HeadShape,
        routing: Optional[RoutingPlan],
        steps: GroupTask,
    ) -> None:
        if group.kind not in ("local", "zigzag", "ulysses", "hierarchical"):
            raise ValueError(f"group {group.index}: kind {group.kind!r} is not an all-to-all/ring group")
        self.group, self.shape, self.steps = group, shape, steps
        a = group.a2a_size if group.kind in ("ulysses", "hierarchical") else 1
        if len(group.ranks) % a:
            raise ValueError(f"group {group.index}: {len(group.ranks)} ranks are not whole nodes of {a}")
        nodes = [group.ranks[j * a : (j + 1) * a] for j in range(len(group.ranks) // a)]
        member = rank in group.ranks
        node, self.local = divmod(group.ranks.index(rank), a) if member else (None, 0)
        self.a = a
        self.rows = Rows.of(group_rows(plan, rank, group.index)) if member else None
        blocks = tuple(concat(member_block(plan, r, group.index) for r in nodes[j]) for j in range(len(nodes)))
        hq, hkv = shape.hq, shape.hkv
        if a > 1:
            assert node is not None, "only zigzag rings (a == 1) have relay-only ranks"
            self.heads = split_heads(hq, hkv, a, what=f"{group.kind} group {group.index}")
            hq, hkv = self.heads.q_count(self.local), self.heads.kv_count(self.local)
            self.node = nodes[node]
            self.node_rows = [block_rows(member_block(plan, r, group.index)) for r in self.node]
            self.offsets = [sum(self.node_rows[:m]) for m in range(a)]
            s, d, dv = self.heads, shape.d, shape.dv
            qkv_width = lambda m: s.q_count(m) * d + s.kv_count(m) * (d + dv)  # noqa: E731
            out_width = lambda m: s.q_count(m) * dv  # noqa: E731
            name = f"all-to-all of group {group.index}"
            self.fwd_in = _a2a(f"q/k/v {name}", self.node, self.node_rows, qkv_width, to_owner=False)
            self.fwd_out = _a2a(f"output {name}", self.node, self.node_rows, out_width, to_owner=True)
            self.bwd_in = _a2a(f"dO {name}", self.node, self.node_rows, out_width, to_owner=False)
            self.bwd_out = _a2a(f"dQ/dK/dV {name}", self.node, self.node_rows, qkv_width, to_owner=True)
        ring_members = tuple(nodes[j][self.local] for j in range(len(nodes)))
        self.ring = Ring(
            group.index, ring_members, blocks, node, hkv, shape.d, shape.dv, routing if group.kind == "zigzag" else None
        )

    def involves(self, rank: int) -> bool:
        return rank in self.group.ranks or self.ring.involves(rank)

    # ---- all-to-all helpers ----------------------------------------------------------------------
    def _heads(self, x: Tensor, m: int, kv: bool) -> Tensor:
        lo, hi = (self.heads.kv if kv else self.heads.q)[m]
        return x[:, lo:hi]

    def _post(self, rt: RunContext, exchange: Exchange, payload, dtype: torch.dtype):
        me, a = self.local, self.a
        return exchange.post(rt.comm, {me * a + m: payload(m) for m in range(a)}, dtype=dtype, device=rt.device)

    def _from_each(self, got: dict) -> list[Tensor]:
        """The message from each node member ``m``, in member order."""
        me, a = self.local, self.a
        return [got[m * a + me] for m in range(a)]

    # ---- passes -----------------------------------------------------------------------------------
    def _exchange(self, rt: RunContext, steps, post):
        """Generator over one all-to-all's POST, ROUND, WAIT steps; returns what arrived, per member."""
        box: dict = {}

        def run_step(step) -> None:
            if step.op == "POST":
                box["pending"] = post()
            else:
                assert "pending" in box, "an all-to-all posts before it waits"
                box["got"] = self._from_each(box.pop("pending").wait())

        yield from walk_steps(self.steps, steps, rt, run_step)
        return box["got"]

    def _ring(self, rt: RunContext, steps, *args, backward: bool):
        return self.ring.run(self.steps, steps, rt, *args, backward=backward)

    def forward(self, rt: RunContext, q: Optional[Tensor], k: Optional[Tensor], v: Optional[Tensor]):
        """Generator over the task's forward steps; returns ``(out, saved)`` for this rank's tokens."""
        steps = self.steps.forward
        if self.a == 1:
            result = yield from self._ring(rt, steps, q, k, v, backward=False)
            if result is None:
                return None, None
            return result[0], (q, k, v, *result)
        assert q is not None and k is not None and v is not None, "an all-to-all member holds rows"
        d, dv = q.shape[2], v.shape[2]
        got = yield from self._exchange(
            rt,
            steps[:3],
            lambda: self._post(
                rt,
                self.fwd_in,
                lambda m: pack(self._heads(q, m, False), self._heads(k, m, True), self._heads(v, m, True)),
                rt.dtype,
            ),
        )
        hq, hkv = self.heads.q_count(self.local), self.heads.kv_count(self.local)
        parts = [unpack(x, (hq, d), (hkv, d), (hkv, dv)) for x in got]
        qh, kh, vh = (torch.cat([p[i] for p in parts]).contiguous() for i in range(3))
        out_h, lse_h = yield from self._ring(rt, steps[3:-3], qh, kh, vh, backward=False)
        o, r = self.offsets, self.node_rows
        got = yield from self._exchange(
            rt,
            steps[-3:],
            lambda: self._post(rt, self.fwd_out, lambda m: flat2d(out_h[o[m] : o[m] + r[m]]).contiguous(), rt.dtype),
        )
        n = r[self.local]
        out = torch.cat([x.view(n, self.heads.q_count(m), dv) for m, x in enumerate(got)], dim=1)
        return out, (qh, kh, vh, out_h, lse_h)

    def backward(self, rt: RunContext, dout: Optional[Tensor], saved):
        """Generator over the task's backward steps; returns ``(dq, dk, dv)`` (``None`` when relay-only)."""
        steps = self.steps.backward
        if self.a == 1:
            return (yield from self._ring(rt, steps, dout, saved, backward=True))
        assert dout is not None, "an all-to-all member holds rows"
        qh, kh, vh, _, _ = saved
        d, dv = qh.shape[2], vh.shape[2]
        got = yield from self._exchange(
            rt,
            steps[:3],
            lambda: self._post(rt, self.bwd_in, lambda m: flat2d(self._heads(dout, m, False)).contiguous(), rt.dtype),
        )
        hq = self.heads.q_count(self.local)
        dout_h = torch.cat([x.view(x.shape[0], hq, dv) for x in got]).contiguous()
        dq_h, dk_h, dv_h = yield from self._ring(rt, steps[3:-3], dout_h, saved, backward=True)
        o, r = self.offsets, self.node_rows
        got = yield from self._exchange(
            rt,
            steps[-3:],
            lambda: self._post(
                rt,
                self.bwd_out,
                lambda m: pack(*(t[o[m] : o[m] + r[m]].to(rt.dtype) for t in (dq_h, dk_h, dv_h))),
                rt.dtype,
            ),
        )
        n, s, acc = r[self.local], self.heads, rt.acc_dtype
        hq, hkv = self.shape.hq, self.shape.hkv
        dq = torch.zeros(n, hq, d, dtype=acc, device=rt.device)
        dk = torch.zeros(n, hkv, d, dtype=acc, device=rt.device)
        dvv = torch.zeros(n, hkv, dv, dtype=acc, device=rt.device)
        for m, x in enumerate(got):
            gq, gk, gv = unpack(x, (s.q_count(m), d), (s.kv_count(m), d), (s.kv_count(m), dv))
            self._heads(dq, m, False).copy_(gq)
            self._heads(dk, m, True).add_(gk)  # K/V heads replicated over members sum their shares
            self._heads(dvv, m, True).add_(gv)
        return dq, dk, dvv
