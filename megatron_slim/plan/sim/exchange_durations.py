"""``GroupDurations`` (``plan/schedule/exchange_groups.py``) from a cost model.

An action's full time is what the simulator charges it unexchanged (``engine.compute_time``); its
movable time is the attention of its slice's queries against its whole K/V prefix, priced as the
block the simulator would move (``ExchangeCosts.exchange`` with the whole prefix), so the planner's
seconds and the simulator's agree: a block of ``k`` of the ``prefix`` tokens costs ``k / prefix``
of it. A first slice (prefix 0) and a ``W`` (no attention) have nothing to move.
"""

from __future__ import annotations

from typing import Sequence, cast

from megatron_slim.plan.cost.slicing import slice_prefixes
from megatron_slim.plan.schedule.ir import Action, Kind, Schedule
from megatron_slim.plan.sim.costs import ExchangeCosts, PipelineCosts
from megatron_slim.plan.sim.engine import compute_time


class CostDurations:
    """Full and movable seconds of ``schedule``'s actions under ``costs``, slices of ``lengths``."""

    def __init__(self, schedule: Schedule, costs: PipelineCosts, lengths: Sequence[int]) -> None:
        if not hasattr(costs, "exchange"):
            name = type(costs).__name__
            raise TypeError(f"{name} cannot price context exchange: it has no exchange() (ExchangeCosts)")
        self.schedule = schedule
        self.costs = costs
        self.exchange_costs = cast(ExchangeCosts, costs)
        self.prefixes = slice_prefixes(tuple(lengths))

    def full(self, rank: int, action: Action) -> float:
        return compute_time(self.costs, self.schedule.stage(rank, action.chunk), action)

    def movable(self, rank: int, action: Action) -> float:
        prefix = self.prefixes[action.slice]
        if prefix == 0 or action.kind is Kind.W:
            return 0.0
        stage = self.schedule.stage(rank, action.chunk)
        backward = action.kind.is_backward
        return self.exchange_costs.exchange(stage, action.microbatch, action.slice, prefix, backward).block_s
