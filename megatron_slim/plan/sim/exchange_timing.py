"""The context-exchange plan read off simulated time: the one ``megatron-slim simulate`` prices and
``megatron-slim train`` runs.

``plan/schedule/exchange_groups.py`` plans groups of whole unit-time slots, both passes, balanced
by the cost model (``CostDurations``). Within a group a taker serves its senders in plan order, so
the order that matters is the order the senders' messages arrive, which only a simulation knows:
the first plan takes rank order, each of ``rounds`` more the order the senders started in the
previous round's simulation, and the lowest-bubble plan is kept (13B 256K p8 v5 n16: 2.39% in rank
order, then 1.46%, 1.24%, 1.23%).

The plan is a pure function of the cost model, the schedule shape and the slice lengths
(``timed_exchange_schedule``: a recipe, a microbatch count and slice lengths), carried by the
schedule (``Schedule.exchange``, in its digest), so the simulator and every training rank read the
same blocks. Every plan has passed ``drop_deadlocks``, so it runs under the runtime's per-layer
rendezvous.
"""

from __future__ import annotations

import functools
from typing import Optional

from megatron_slim.plan.progress import Progress
from megatron_slim.plan.recipe import Recipe
from megatron_slim.plan.schedule.exchange_blocks import RankAction
from megatron_slim.plan.schedule.exchange_groups import with_group_exchange
from megatron_slim.plan.schedule.executable import PLANS_KEPT, executable
from megatron_slim.plan.schedule.ir import Action, Schedule
from megatron_slim.plan.schedule.lower import lower
from megatron_slim.plan.schedule.validate import check_link_order, validate
from megatron_slim.plan.sim.costs import PipelineCosts, RecipeCosts
from megatron_slim.plan.sim.engine import SimResult, simulate
from megatron_slim.plan.sim.exchange_durations import CostDurations

GROUP_ROUNDS = 2  # sender order from the simulated starts: 13B 256K 2.39% (rank order) -> 1.46%, 1.24%, 1.23%


def _starts(result: SimResult) -> dict[RankAction, float]:
    return {(e.rank, Action.parse(e.name)): e.start for e in result.events if e.stream == "compute"}


def simulate_with_group_exchange(
    schedule: Schedule,
    costs: PipelineCosts,
    lengths: tuple[int, ...],
    granule: int = 1,
    rounds: int = GROUP_ROUNDS,
    progress: Optional[Progress] = None,
) -> SimResult:
    """The best simulation of lowered ``schedule`` with its group exchange plan (unit-time
    groups, whole durations equalised under ``costs``, blocks in multiples of ``granule`` tokens):
    the first plan's takers serve a group's senders in rank order, each of ``rounds`` more in the order
    they started in the previous round's simulation."""
    durations = CostDurations(schedule, costs, lengths)
    best: Optional[SimResult] = None
    starts: Optional[dict[RankAction, float]] = None
    for _ in range(rounds + 1):
        planned = with_group_exchange(schedule, lengths, durations, granule, starts=starts)
        result = simulate(planned, costs, progress)
        if best is None or result.bubble_ratio < best.bubble_ratio:
            best = result
        starts = _starts(result)
    assert best is not None
    return best


def simulate_as_planned(schedule: Schedule, costs: RecipeCosts, progress: Optional[Progress] = None) -> SimResult:
    """``schedule`` (generated for ``costs.recipe``) simulated as ``megatron-slim simulate`` prints and
    ``megatron-slim plan`` ranks it: a context-exchange recipe on several pipeline ranks with its
    group plan, any other as generated."""
    recipe = costs.recipe
    if recipe.schedule.kind == "slimpipe" and recipe.schedule.slice_policy == "exchange" and recipe.parallel.pp > 1:
        return simulate_with_group_exchange(lower(schedule), costs, costs.lengths, progress=progress)
    return simulate(schedule, costs, progress)


@functools.lru_cache(maxsize=PLANS_KEPT)
def timed_exchange_schedule(recipe: Recipe, num_microbatches: int, lengths: tuple[int, ...]) -> Schedule:
    """The executable schedule of ``recipe``'s pipeline with ``num_microbatches`` and slices of
    ``lengths``, carrying the group plan ``megatron-slim simulate`` prices for them (the recipe's cost
    model, no calibration, granule 1): what ``megatron-slim train`` runs. Planned once per argument
    set and process."""
    s, p = recipe.schedule, recipe.parallel
    costs = RecipeCosts(recipe, lengths=lengths)
    schedule = executable(s.kind, p.pp, p.vpp, num_microbatches, len(lengths))
    timed = simulate_with_group_exchange(schedule, costs, lengths).schedule
    return check_link_order(validate(timed))
