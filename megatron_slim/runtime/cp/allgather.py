"""The ``allgather`` group (Llama-3 style CP): every member's K/V goes to every other member first.

Queries stay where the plan put them (zigzag chunks); keys are the whole sequence, gathered as
member blocks, so each block is attended with the same pair rule as a ring step. The backward
gathers the K/V again (nothing gathered is kept between passes), then sends every block's dK/dV
share home, where the owner sums them (a reduce-scatter made of point-to-point messages).
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_slim.plan.cp.layout import CPGroup, CPPlan
from megatron_slim.plan.cp.program import GroupTask
from megatron_slim.runtime.cp.block_attention import Rows, backward_into, forward_into, new_accumulators, pair_calls
from megatron_slim.runtime.cp.exchange import Exchange, Hop
from megatron_slim.runtime.cp.run_context import HeadShape, RunContext, pack, unpack, walk_steps
from megatron_slim.runtime.cp.spans import block_rows, group_rows, member_block

Tensor = torch.Tensor


class AllGatherTask:
    def __init__(self, plan: CPPlan, group: CPGroup, rank: int, shape: HeadShape, steps: GroupTask) -> None:
        ranks = group.ranks
        self.steps = steps
        self.group, self.i, g = group, ranks.index(rank), len(ranks)
        self.rows = Rows.of(group_rows(plan, rank, group.index))
        blocks = [member_block(plan, r, group.index) for r in ranks]
        self.calls = [pair_calls(blocks[self.i], blocks[j], own=j == self.i) for j in range(g)]
        self.kv_shapes = ((shape.hkv, shape.d), (shape.hkv, shape.dv))
        width = shape.hkv * (shape.d + shape.dv)
        pairs = [(j, m) for j in range(g) for m in range(g) if j != m]
        self.index = {pair: n for n, pair in enumerate(pairs)}  # (sender, receiver) -> hop
        rows = [block_rows(b) for b in blocks]
        self.gather = Exchange(
            f"K/V all-gather of group {group.index}", tuple(Hop(ranks[j], ranks[m], rows[j], width) for j, m in pairs)
        )
        self.scatter = Exchange(
            f"dK/dV reduce-scatter of group {group.index}",
            tuple(Hop(ranks[j], ranks[m], rows[m], width) for j, m in pairs),
        )

    def involves(self, rank: int) -> bool:
        return rank in self.group.ranks

    def _others(self):
        return [j for j in range(len(self.calls)) if j != self.i]

    def _gather(self, rt: RunContext, k: Tensor, v: Tensor):
        kv = pack(k, v)
        return self.gather.post(
            rt.comm, {self.index[(self.i, m)]: kv for m in self._others()}, dtype=rt.dtype, device=rt.device
        )

    def _gather_handlers(self, rt: RunContext, k: Tensor, v: Tensor, st: dict) -> dict:
        """POST sends this member's K/V to the others (pending in ``st``); WAIT puts what came in ``st["got"]``."""
        return {
            ("POST", "GATHER"): lambda _: st.update(pending=self._gather(rt, k, v)),
            ("WAIT", "GATHER"): lambda _: st.update(got=st["pending"].wait()),
        }

    def _block(self, got: dict, j: int) -> tuple[Tensor, Tensor]:
        k, v = unpack(got[self.index[(j, self.i)]], *self.kv_shapes)
        return k.contiguous(), v.contiguous()

    def _walk(self, rt: RunContext, steps, handlers: dict):
        """Generator: ``handlers[(op, what)](step)`` for each step, a yield at each ``ROUND``."""
        yield from walk_steps(self.steps, steps, rt, lambda step: handlers[(step.op, step.what)](step))

    def forward(self, rt: RunContext, q: Tensor, k: Tensor, v: Tensor):
        st: dict = {}
        acc_out, acc_lse = new_accumulators(q.shape[0], q.shape[1], v.shape[2], q)

        def compute(step) -> None:
            j = (self.i - step.step) % len(self.calls)
            kj, vj = (k, v) if j == self.i else self._block(st["got"], j)
            forward_into(rt.backend, rt.scale, self.calls[j], q, kj, vj, acc_out, acc_lse)

        yield from self._walk(
            rt,
            self.steps.forward,
            {
                **self._gather_handlers(rt, k, v, st),
                ("C", ""): compute,
            },
        )
        out = acc_out.to(rt.dtype)
        return out, (q, k, v, out, acc_lse)

    def backward(self, rt: RunContext, dout: Optional[Tensor], saved):
        assert dout is not None, "every all-gather member holds rows"
        q, k, v, out, lse = saved
        acc = rt.acc_dtype
        dq, dk, dv = (torch.zeros(t.shape, dtype=acc, device=t.device) for t in (q, k, v))
        st: dict = {"shares": {}}

        def compute(step) -> None:
            j = (self.i - step.step) % len(self.calls)
            if j == self.i:
                backward_into(rt.backend, rt.scale, self.calls[j], dout, q, k, v, out, lse, dq, dk, dv)
                return
            kj, vj = self._block(st["got"], j)
            dkj, dvj = (torch.zeros(t.shape, dtype=acc, device=t.device) for t in (kj, vj))
            backward_into(rt.backend, rt.scale, self.calls[j], dout, q, kj, vj, out, lse, dq, dkj, dvj)
            st["shares"][self.index[(self.i, j)]] = pack(dkj, dvj)

        def gathered(_: object) -> None:
            st.update(scattered=st["pending"].wait())
            for j in self._others():
                gk, gv = unpack(st["scattered"][self.index[(j, self.i)]], *self.kv_shapes)
                dk.add_(gk)
                dv.add_(gv)

        yield from self._walk(
            rt,
            self.steps.backward,
            {
                **self._gather_handlers(rt, k, v, st),
                ("C", ""): compute,
                ("POST", "SCATTER"): lambda _: st.update(
                    pending=self.scatter.post(rt.comm, st["shares"], dtype=acc, device=rt.device)
                ),
                ("WAIT", "SCATTER"): gathered,
            },
        )
        return dq, dk, dv
