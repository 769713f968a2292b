"""The attention engine: runs one rank's part of a ``CPPlan`` for an attention layer, with autograd.

``CPAttentionEngine(group)`` is built once per CP process group and shared by every layer.
``prepare(plan, routing)`` is collective (all CP ranks, once per plan): it checks that every rank
holds the same plan and makes it current. ``engine(q, k, v)`` then takes this rank's
``[tokens, heads, d]`` q/k/v in the plan's attention-layout order and returns each token's causal
attention over its whole sequence, differentiable; a forward remembers its plan, so the backward
is right even if another plan was prepared in between (pipeline schedules).

Execution is a small interpreter over the rank's group tasks in queue order (inter-node, then
intra-node, then local): ``run_queues`` advances every task by one round, in that order, round
after round. Round 0 only posts each group's first transfer, so the slowest (inter-node) transfer
starts first and every later compute round fills the waits. A task waits only for messages of its
own group posted in an earlier round (or earlier in the same round, within one exchange), and
every rank runs the same tasks in the same order, so no wait can close a cycle and both ends of
every directed pair post their messages in one order.
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

import torch

from megatron_slim.plan.cp.layout import CPPlan
from megatron_slim.plan.cp.routing import RoutingPlan
from megatron_slim.runtime.agreement import check_agreement
from megatron_slim.runtime.attention import AttentionBackend, select_backend
from megatron_slim.runtime.cp.agreement import fingerprint
from megatron_slim.runtime.cp.comm import Comm
from megatron_slim.runtime.cp.program import RankProgram, compile_rank
from megatron_slim.runtime.cp.run_context import HeadShape, RunContext

Tensor = torch.Tensor


def run_queues(tasks: list) -> list[Any]:
    """Advance every generator one round at a time, in list order; return their return values.
    (Each step labels itself for torch's profiler: ``run_context.walk_steps``.)"""
    results: list[Any] = [None] * len(tasks)
    active = list(range(len(tasks)))
    while active:
        still = []
        for i in active:
            try:
                next(tasks[i])
                still.append(i)
            except StopIteration as stop:
                results[i] = stop.value
        active = still
    return results


@dataclass
class _Pass:
    program: RankProgram
    rt: RunContext
    saved: list
    shapes: tuple  # shapes of q, k, v


class CPAttentionEngine:
    def __init__(self, group, *, cache_size: int = 4) -> None:
        self.comm = Comm(group)
        self.plan: Optional[CPPlan] = None
        self.routing: Optional[RoutingPlan] = None
        self.fingerprint: Optional[str] = None
        self._programs: OrderedDict = OrderedDict()
        self._cache_size = cache_size
        # set to {} to record the program steps each pass runs: trace[direction][group] -> step strings
        self.trace: Optional[dict] = None

    @property
    def rank(self) -> int:
        return self.comm.me

    def prepare(
        self,
        plan: CPPlan,
        routing: Optional[RoutingPlan] = None,
        *,
        device: torch.device | str = "cpu",
        extra: str = "",
    ) -> str:
        """Collective: check every CP rank holds this plan (and routing, and ``extra``), make it current."""
        if plan.num_ranks != self.comm.size:
            raise ValueError(f"plan for {plan.num_ranks} CP ranks, but the CP group has {self.comm.size}")
        digest = fingerprint(plan, routing, extra)
        check_agreement(digest, self.comm.group, device=device)
        self.plan, self.routing, self.fingerprint = plan, routing, digest
        return digest

    def program(self, shape: HeadShape) -> RankProgram:
        if self.plan is None:
            raise RuntimeError("no context-parallel plan: call prepare(plan) on every CP rank first")
        key = (self.fingerprint, shape)
        if key not in self._programs:
            self._programs[key] = compile_rank(self.plan, self.rank, shape, self.routing)
            while len(self._programs) > self._cache_size:
                self._programs.popitem(last=False)
        self._programs.move_to_end(key)
        return self._programs[key]

    # ---- passes ---------------------------------------------------------------------------------
    def forward_pass(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        softmax_scale: Optional[float] = None,
        backend: Optional[AttentionBackend] = None,
    ) -> tuple[Tensor, _Pass]:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        program = self.program(HeadShape.of(q, k, v))
        if q.shape[0] != program.tokens or k.shape[0] != program.tokens or v.shape[0] != program.tokens:
            raise ValueError(
                f"CP rank {self.rank}: q/k/v hold {q.shape[0]}/{k.shape[0]}/{v.shape[0]} tokens, "
                f"the plan gives this rank {program.tokens}"
            )
        scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
        rt = RunContext(
            self.comm,
            backend or select_backend(device=q.device, dtype=q.dtype),
            scale,
            q.dtype,
            q.device,
            self._walked("forward"),
        )
        tasks = [
            t.forward(rt, *((None,) * 3 if t.rows is None else (t.rows.take(x) for x in (q, k, v))))
            for t in program.tasks
        ]
        results = run_queues(tasks)
        self.comm.drain()
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
        for t, (out_g, _) in zip(program.tasks, results):
            if t.rows is not None:
                t.rows.put(out, out_g)
        return out, _Pass(program, rt, [s for _, s in results], (q.shape, k.shape, v.shape))

    def backward_pass(self, state: _Pass, dout: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        dout = dout.contiguous()
        rt = dataclasses.replace(state.rt, walked=self._walked("backward"), backward=True)
        tasks = [
            t.backward(rt, None if t.rows is None else t.rows.take(dout), s)
            for t, s in zip(state.program.tasks, state.saved)
        ]
        results = run_queues(tasks)
        self.comm.drain()
        grads = [torch.empty(shape, dtype=rt.dtype, device=rt.device) for shape in state.shapes]
        for t, result in zip(state.program.tasks, results):
            if t.rows is not None:
                for grad, part in zip(grads, result):
                    t.rows.put(grad, part)
        dq, dk, dv = grads
        return dq, dk, dv

    def _walked(self, direction: str) -> Optional[dict]:
        return None if self.trace is None else self.trace.setdefault(direction, {})

    def __call__(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        softmax_scale: Optional[float] = None,
        backend: Optional[AttentionBackend] = None,
    ) -> Tensor:
        """Differentiable attention of this rank's tokens under the current plan (see module doc)."""
        return _CPAttention.apply(q, k, v, self, softmax_scale, backend)


class _CPAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, engine: CPAttentionEngine, softmax_scale, backend):
        out, state = engine.forward_pass(q, k, v, softmax_scale=softmax_scale, backend=backend)
        ctx.engine, ctx.state = engine, state
        return out

    @staticmethod
    def backward(ctx, dout):
        dq, dk, dv = ctx.engine.backward_pass(ctx.state, dout)
        ctx.state = None
        return dq, dk, dv, None, None, None
