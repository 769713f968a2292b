"""One rank's runnable program: the plan's step program (``plan.cp.program``) bound to tensors' shapes.

``plan.cp.program.lower_rank`` decides which group tasks the rank runs, in which queue order, and
every step of each; this module only attaches, per task, the runtime pieces that execute those
steps (exchanges, pair calls, head splits). Compiled once per (plan, routing, head shape) and
reused by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from megatron_slim.plan.cp.layout import CPPlan
from megatron_slim.plan.cp.program import KINDS, RankSteps, lower_rank
from megatron_slim.plan.cp.routing import RoutingPlan
from megatron_slim.runtime.cp.allgather import AllGatherTask
from megatron_slim.runtime.cp.run_context import HeadShape
from megatron_slim.runtime.cp.split_group import SplitGroupTask

Task = Union[SplitGroupTask, AllGatherTask]
__all__ = ["KINDS", "RankProgram", "compile_rank"]


@dataclass(frozen=True)
class RankProgram:
    rank: int
    tokens: int
    shape: HeadShape
    tasks: tuple[Task, ...]
    steps: RankSteps

    def describe(self) -> str:
        return self.steps.describe()


def compile_rank(plan: CPPlan, rank: int, shape: HeadShape, routing: Optional[RoutingPlan] = None) -> RankProgram:
    steps = lower_rank(plan, rank, routing)
    groups = {g.index: g for g in plan.groups}
    tasks: list[Task] = []
    for gt in steps.tasks:
        group = groups[gt.group]
        if group.kind == "allgather":
            tasks.append(AllGatherTask(plan, group, rank, shape, gt))
        else:
            tasks.append(SplitGroupTask(plan, group, rank, shape, routing, gt))
    return RankProgram(rank, steps.tokens, shape, tuple(tasks), steps)
