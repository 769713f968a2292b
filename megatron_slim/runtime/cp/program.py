"""Lower a ``CPPlan`` (+ ``RoutingPlan``) to one rank's program: its group tasks in queue order.

The queue order is the plan's group order, which ``assemble`` numbers by scope: inter-node groups
first, then intra-node, then local. A rank gets a task for every group it belongs to and, for
routed rings, for every ring it relays for without being a member (proxies of other nodes' hops);
that task runs the ring's communication only. Compiled once per (plan, routing, head shape) and
reused by every layer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from megatron_slim.plan.cp.layout import CPPlan
from megatron_slim.plan.cp.routing import RoutingPlan
from megatron_slim.runtime.cp.allgather import AllGatherTask
from megatron_slim.runtime.cp.run_context import HeadShape
from megatron_slim.runtime.cp.split_group import SplitGroupTask

Task = Union[SplitGroupTask, AllGatherTask]
KINDS = ("local", "zigzag", "hierarchical", "ulysses", "allgather")


@dataclass(frozen=True)
class RankProgram:
    rank: int
    tokens: int
    shape: HeadShape
    tasks: tuple[Task, ...]

    def describe(self) -> str:
        parts = []
        for t in self.tasks:
            g = t.group
            role = "member" if t.rows is not None else "relay"
            parts.append(f"G{g.index}:{g.kind}/{g.scope}({role})")
        return f"rank {self.rank}, {self.tokens} tokens: " + " -> ".join(parts)


def compile_rank(plan: CPPlan, rank: int, shape: HeadShape, routing: Optional[RoutingPlan] = None) -> RankProgram:
    if not 0 <= rank < plan.num_ranks:
        raise ValueError(f"rank {rank}: the plan has ranks 0..{plan.num_ranks - 1}")
    relayed = {h.group for h in routing.hops if h.route.routed} if routing is not None else set()
    tasks: list[Task] = []
    for group in sorted(plan.groups, key=lambda g: (g.priority, g.index)):
        if group.kind not in KINDS:
            raise ValueError(f"group {group.index}: kind {group.kind!r} is unknown; allowed: {', '.join(KINDS)}")
        member = rank in group.ranks
        if group.kind == "allgather":
            if member:
                tasks.append(AllGatherTask(plan, group, rank, shape))
            continue
        if not member and group.index not in relayed:
            continue
        task = SplitGroupTask(plan, group, rank, shape, routing)
        if member or task.involves(rank):
            tasks.append(task)
    covered = sum(t.rows.count for t in tasks if t.rows is not None)
    if covered != plan.ranks[rank].num_tokens:
        raise ValueError(f"rank {rank}: its groups cover {covered} of its {plan.ranks[rank].num_tokens} tokens; "
                         "the plan is inconsistent")
    return RankProgram(rank, plan.ranks[rank].num_tokens, shape, tuple(tasks))
