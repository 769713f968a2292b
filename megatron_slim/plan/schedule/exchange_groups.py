"""Context exchange by groups: every compute action of one time slot, both passes, ends together.

A 1F1B-style slot holds forwards on some ranks and backwards (about twice as long) on others, so
balancing one pass at a time cannot even out a slot. Here a *group* is every compute action
except ``W``, of either pass, that runs at one moment of a timeline (default: ``unit_timeline``,
where a group is one unit-time slot), on distinct ranks. Its members get equal *whole* durations
by water-filling (``equal_time_shares``): a member keeps its non-movable work and can give away at
most its *movable* attention (its slice's queries against its whole K/V prefix); a taker takes
any amount. So work that cannot move (the output layer on the last rank) is compensated by
moving attention off that rank.

Each sender's excess is split over the group's takers in proportion to their deficits and
converted to K/V tokens of its prefix (a block's time is linear in its tokens: ``tokens = prefix x
seconds / movable``), rounded to ``granule`` tokens (the runtime's zigzag CP needs multiples of
2 x the CP size). A sender's blocks run contiguously from 0 over its takers in rank order
(``[0, a), [a, b), ...``), empty ones dropped. A taker serves its blocks in plan order, so the plan
lists blocks by group, then by sender in the order of ``starts``. On the unit timeline a slot's
members tie (so do they when every member lasts its balanced duration): the order that matters
comes from the messages' times, which only a simulation knows (``plan/sim/exchange_timing.py``
re-plans with simulated starts; a taker that serves a late sender first holds up the early ones).
The costs come in as a ``GroupDurations`` (``plan/sim/exchange_durations.py`` answers it from
``PipelineCosts``).
``with_group_exchange`` stores the plan after ``drop_deadlocks``.
"""

from __future__ import annotations

import dataclasses
from itertools import accumulate
from typing import Mapping, Optional, Protocol, Sequence

from megatron_slim.plan.schedule.exchange import Interval, concurrent, drop_deadlocks, unit_timeline
from megatron_slim.plan.schedule.exchange_blocks import ExchangeBlock, ExchangePlan, RankAction
from megatron_slim.plan.schedule.ir import Action, Kind, Schedule


class GroupDurations(Protocol):
    """Seconds of a compute action on a rank, unexchanged: all of it, and the movable part."""

    def full(self, rank: int, action: Action) -> float: ...
    def movable(self, rank: int, action: Action) -> float: ...


def equal_time_shares(fulls: Sequence[float], moves: Sequence[float]) -> list[float]:
    """The movable seconds each member ends up with so that whole durations are equal, as far as
    no member goes below its fixed part ``full - movable`` (water-filling); the sum is kept."""
    bases = sorted(f - m for f, m in zip(fulls, moves))
    total = sum(moves)
    level = bases[0] if bases else 0.0
    for k in range(len(bases), 0, -1):  # the k lowest fixed parts share all the movable time
        level = (total + sum(bases[:k])) / k
        if level >= bases[k - 1]:
            break
    return [max(0.0, level - (f - m)) for f, m in zip(fulls, moves)]


def slot_groups(timeline: Mapping[RankAction, Interval]) -> list[list[RankAction]]:
    """Compute actions of either pass (``W`` aside) on distinct ranks running at one moment."""
    return concurrent([(t, ra) for ra, t in timeline.items() if ra[1].kind is not Kind.W])


def _boundary(tokens: float, granule: int, cap: int) -> int:
    """``tokens`` rounded to the nearest multiple of ``granule``, at most ``cap``."""
    return min(cap, granule * int(tokens / granule + 0.5))


def _balanced(group: list[RankAction], durations: GroupDurations) -> dict[RankAction, tuple[float, float]]:
    """Each member's (movable seconds, movable seconds it ends up with)."""
    moves = [durations.movable(r, a) for r, a in group]
    shares = equal_time_shares([durations.full(r, a) for r, a in group], moves)
    return {ra: (m, s) for ra, m, s in zip(group, moves, shares)}


def _group_blocks(
    step: int, group: list[RankAction], prefixes: Sequence[int], durations: GroupDurations, granule: int
) -> list[ExchangeBlock]:
    """The blocks of one group, by sender in ``group`` order, each sender's over takers by rank."""
    balanced = _balanced(group, durations)
    takers = sorted((ra, s - m) for ra, (m, s) in balanced.items() if s > m)
    deficit = sum(d for _, d in takers)
    blocks: list[ExchangeBlock] = []
    for rank, a in group:
        move, share = balanced[(rank, a)]
        if move <= share or deficit <= 0:
            continue
        prefix = prefixes[a.slice]
        cap = prefix // granule * granule
        given = accumulate((move - share) * d / deficit for _, d in takers)
        ends = [_boundary(prefix * s / move, granule, cap) for s in given]
        for ((t_rank, t_action), _), start, end in zip(takers, [0, *ends], ends):
            if end > start:
                blocks.append(ExchangeBlock(step, rank, a, t_rank, t_action, start, end))
    return blocks


def plan_group_exchange(
    schedule: Schedule,
    lengths: Sequence[int],
    durations: GroupDurations,
    granule: int = 1,
    timeline: Optional[Mapping[RankAction, Interval]] = None,
    starts: Optional[Mapping[RankAction, float]] = None,
) -> ExchangePlan:
    """The group plan of a lowered ``schedule`` whose slices have ``lengths`` tokens, groups read
    from ``timeline`` (default: ``unit_timeline``), block bounds in multiples of ``granule``
    tokens, each group's senders served in the order of ``starts`` (default: the timeline's
    starts; ties by rank). No deadlock check."""
    if len(lengths) != schedule.num_slices:
        raise ValueError(f"exchange: {len(lengths)} slice lengths for {schedule.num_slices} slices")
    if not schedule.is_lowered:
        raise ValueError("exchange: plan the lowered schedule (schedule.lower.lower), the one ranks execute")
    if granule < 1:
        raise ValueError(f"exchange: granule={granule} tokens; it must be a positive integer")
    prefixes = [0, *accumulate(lengths)][:-1]
    timeline = timeline if timeline is not None else unit_timeline(schedule)
    groups = slot_groups(timeline)
    starts = starts if starts is not None else {ra: t[0] for ra, t in timeline.items()}
    blocks: list[ExchangeBlock] = []
    for step, group in enumerate(groups):
        ordered = sorted(group, key=lambda ra: (starts[ra], ra[0]))  # senders in start order
        blocks += _group_blocks(step, ordered, prefixes, durations, granule)
    return ExchangePlan(tuple(blocks))


def with_group_exchange(
    schedule: Schedule,
    lengths: Sequence[int],
    durations: GroupDurations,
    granule: int = 1,
    timeline: Optional[Mapping[RankAction, Interval]] = None,
    starts: Optional[Mapping[RankAction, float]] = None,
) -> Schedule:
    """``schedule`` (lowered) carrying its deadlock-free group exchange plan."""
    plan = plan_group_exchange(schedule, lengths, durations, granule, timeline, starts)
    return drop_deadlocks(dataclasses.replace(schedule, exchange=plan.to_text()))
