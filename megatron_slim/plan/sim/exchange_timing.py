"""Context-exchange pairing read off simulated time: the one ``megatron-slim simulate`` prices and
``megatron-slim train`` runs.

``plan/schedule/exchange.py`` groups actions into steps from a timeline. Its default, the
unit-time timeline, needs no costs, but with uniform slices real actions last from 1x to 6x each
other (causal attention), so actions in one unit slot start far apart in real time and the pair's
coupling (the sender waits for its peer's block) costs more than the moved work saves. Here the
timeline is the simulated one: the schedule without exchange first, then each round re-pairs on
the previous round's simulated timeline (exchange shortens senders and lengthens peers, which
moves the steps). The best of ``rounds`` rounds (lowest bubble) is kept. Then ``slack_rounds``
rounds each drop the pairs whose sender gained nothing (``losing_pairs``) and add pairs among the
actions then unpaired, chosen by idle time on the latest timeline (``exchange_slack.py``: a peer
whose rank would idle after it serves a critical sender), keeping the other pairs; again the
lowest-bubble round is kept.

The pairing is a pure function of the cost model, the schedule shape and the slice lengths
(``timed_exchange_schedule``: a recipe, a microbatch count and slice lengths), carried by the schedule
(``Schedule.exchange``, in its digest), so the simulator and every training rank read the same
pairs. Every round's pairing has passed ``drop_deadlocks``, so it runs under the runtime's
per-layer rendezvous.

``simulate_with_group_exchange`` prices the other plan, groups of whole unit-time slots balanced
across both passes (``plan/schedule/exchange_groups.py``); the runtime cannot run it yet, so
neither ``simulate`` nor ``train`` uses it by default.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

from megatron_slim.plan.progress import Progress
from megatron_slim.plan.recipe import Recipe
from megatron_slim.plan.schedule.exchange import drop_deadlocks, with_exchange
from megatron_slim.plan.schedule.exchange_blocks import ExchangePlan, RankAction
from megatron_slim.plan.schedule.exchange_groups import with_group_exchange
from megatron_slim.plan.schedule.executable import PLANS_KEPT, executable
from megatron_slim.plan.schedule.ir import Action, Schedule
from megatron_slim.plan.schedule.validate import check_link_order, validate
from megatron_slim.plan.sim.costs import PipelineCosts, RecipeCosts
from megatron_slim.plan.sim.engine import SimResult, simulate
from megatron_slim.plan.sim.exchange_durations import CostDurations
from megatron_slim.plan.sim.exchange_slack import losing_pairs, slack_pairs

ROUNDS = 6  # the bubble stops improving after about six rounds (13B 256K p8 v5 n16: 12.9% -> 10.4%)
GROUP_ROUNDS = 2  # sender order from the simulated starts: 13B 256K 2.39% (rank order) -> 1.46%, 1.24%, 1.23%
SLACK_ROUNDS = 6  # idle-time rounds, each dropping losing pairs first: 10.4% -> 8.7%, 8.2%, 8.0%, then < 0.1 pt


def _timeline(result: SimResult) -> dict[RankAction, tuple[float, float]]:
    return {(e.rank, Action.parse(e.name)): (e.start, e.end) for e in result.events if e.stream == "compute"}


def simulate_with_exchange(
    schedule: Schedule,
    costs: PipelineCosts,
    lengths: tuple[int, ...],
    rounds: int = ROUNDS,
    progress: Optional[Progress] = None,
    slack_rounds: int = SLACK_ROUNDS,
) -> SimResult:
    """The best simulation of lowered ``schedule`` with a pairing re-derived from simulated time."""
    result = simulate(schedule, costs, progress)
    best: Optional[SimResult] = None
    for _ in range(rounds):
        result = simulate(with_exchange(schedule, lengths, _timeline(result)), costs, progress)
        if best is None or result.bubble_ratio < best.bubble_ratio:
            best = result
    assert best is not None, "rounds must be >= 1"
    return _with_slack_pairs(best, costs, lengths, slack_rounds, progress)


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
        starts = {ra: t[0] for ra, t in _timeline(result).items()}
    assert best is not None
    return best


def _with_slack_pairs(
    best: SimResult, costs: PipelineCosts, lengths: tuple[int, ...], rounds: int, progress: Optional[Progress]
) -> SimResult:
    """``best`` or, if lower in bubble, a round that dropped its losing pairs and added idle-time pairs."""
    result = best
    for _ in range(rounds):
        losing = losing_pairs(result, costs)
        pairs = ExchangePlan.from_text(result.schedule.exchange).blocks
        taken = ExchangePlan(tuple(p for p in pairs if p not in losing))
        step = max((p.step for p in taken.blocks), default=-1) + 1
        added = slack_pairs(result, costs, lengths, step, taken)
        if not added and not losing:
            break
        plan = ExchangePlan(tuple(sorted(taken.blocks + tuple(added))))
        schedule = drop_deadlocks(dataclasses.replace(result.schedule, exchange=plan.to_text()))
        result = simulate(schedule, costs, progress)
        if result.bubble_ratio < best.bubble_ratio:
            best = result
    return best


@functools.lru_cache(maxsize=PLANS_KEPT)
def timed_exchange_schedule(recipe: Recipe, num_microbatches: int, lengths: tuple[int, ...]) -> Schedule:
    """The executable schedule of ``recipe``'s pipeline with ``num_microbatches`` and slices of
    ``lengths``, carrying the pairing ``megatron-slim simulate`` prices for them (the recipe's cost
    model, no calibration): what ``megatron-slim train`` runs. Planned once per argument set and process."""
    s, p = recipe.schedule, recipe.parallel
    costs = RecipeCosts(recipe, lengths=lengths)
    schedule = executable(s.kind, p.pp, p.vpp, num_microbatches, len(lengths))
    timed = simulate_with_exchange(schedule, costs, lengths).schedule
    return check_link_order(validate(timed))
