"""Context exchange: pair compute actions of ranks at different K/V prefix lengths.

With uniform slices, causal attention makes a slice's work grow with its prefix, and at any moment
the pipeline ranks work on slices at different prefixes. Ranks running the same kind of pass at
the same step sort by prefix and pair mirrored (longest with shortest, second with second-shortest,
…); the longer-prefix rank moves the oldest whole slices of its K/V prefix to the peer, as many as
bring the pair's causal attention work closest to equal (``moved_tokens``, never more than its
prefix). A lone rank in a step (warmup, cooldown, the middle of an odd count) keeps its work.

Step: a group of compute actions of one pass on distinct ranks that all run at one moment of a
timeline ((start, end) per action; ``_steps``). Forwards pair with forwards and backwards
(``B``/``I``) with backwards; ``W`` has no attention. A pair is formed only where the peer has
started by the time the sender starts, since the sender waits for the peer's block. The default
timeline, ``unit_timeline`` (every compute one time unit, messages none), depends on the lowered
schedule alone, and its slot grid is the schedule's own lock-step (its bubble matches the closed
form), so the simulator and a runtime read the same pairing whatever the costs. A caller may pass
another timeline (real actions last 1x to 6x each other under uniform slices); the pairing is a
value in the schedule either way, not recomputed by readers. ``megatron-slim simulate`` and
``train`` plan with the group planner instead (``exchange_groups.py``, ``plan/sim/exchange_timing.py``);
this pairing serves callers without a recipe's cost model (``executable_with_exchange``).

``with_exchange`` stores the pairing in ``Schedule.exchange`` (and so in its digest), after
``drop_deadlocks`` has removed any pair the shared readiness walk cannot run.
"""

from __future__ import annotations

import bisect
import dataclasses
from itertools import accumulate
from typing import Mapping, Optional, Sequence

from megatron_slim.plan.schedule.exchange_blocks import ExchangeBlock, ExchangePlan, RankAction
from megatron_slim.plan.schedule.ir import Action, Kind, Schedule
from megatron_slim.plan.schedule.walk import Walker

Interval = tuple[float, float]


def unit_timeline(schedule: Schedule) -> dict[RankAction, Interval]:
    """(start, end) of each compute action when compute takes 1 and messages 0 (pairing ignored)."""
    free = [0] * schedule.pp
    starts: dict[RankAction, Interval] = {}

    def step(rank: int, a: Action, ready: float) -> float:
        if a.kind.is_compute:
            start = max(free[rank], int(ready))
            starts[(rank, a)] = (start, start + 1)
            free[rank] = start + 1
            return float(start + 1)
        if a.kind in (Kind.RECV_F, Kind.RECV_B):
            free[rank] = max(free[rank], int(ready))
            return float(free[rank])
        return ready

    stuck = Walker(dataclasses.replace(schedule, exchange="")).run(step)
    if stuck:
        raise ValueError(f"exchange: the schedule deadlocks before any pairing (ranks stuck: {stuck})")
    return starts


def causal_work(tokens: int, prefix: int) -> int:
    """Query-key pairs a slice scores causally (twice, to stay integral)."""
    return 2 * tokens * prefix + tokens * (tokens + 1)


def moved_tokens(prefixes: Sequence[int], long: tuple[int, int], short: tuple[int, int]) -> int:
    """Tokens of the oldest whole slices the longer-prefix slice ``long`` = (tokens, slice index)
    moves so that the pair's causal work is closest to equal (``prefixes[j]``: slice j's prefix)."""
    (t_long, j_long), (t_short, j_short) = long, short
    excess = causal_work(t_long, prefixes[j_long]) - causal_work(t_short, prefixes[j_short])
    if excess <= 0:
        return 0
    target = excess / (4 * t_long)  # moving m tokens shifts 2*t_long*m from one side to the other
    candidates = prefixes[: j_long + 1]
    k = bisect.bisect_left(candidates, target)
    best = min(candidates[max(k - 1, 0) : k + 1], key=lambda m: (abs(excess - 4 * t_long * m), m))
    return best


def _pair_step(
    step: int,
    members: list[RankAction],
    lengths: Sequence[int],
    prefixes: Sequence[int],
    timeline: Mapping[RankAction, Interval],
) -> list[ExchangeBlock]:
    ordered = sorted(members, key=lambda m: (-prefixes[m[1].slice], m[0]))
    pairs = []
    for i in range(len(ordered) // 2):
        (s_rank, s_act), (p_rank, p_act) = sender, peer = ordered[i], ordered[-1 - i]
        if timeline[peer][0] > timeline[sender][0]:
            continue  # the sender would wait for a peer that has not started yet
        moved = moved_tokens(prefixes, (lengths[s_act.slice], s_act.slice), (lengths[p_act.slice], p_act.slice))
        if moved > 0:
            pairs.append(ExchangeBlock(step, s_rank, s_act, p_rank, p_act, 0, moved))
    return pairs


def concurrent(members: list[tuple[Interval, RankAction]]) -> list[list[RankAction]]:
    """Groups of ``members`` ((start, end), (rank, action)) on distinct ranks that all run at one
    moment: a sweep in start order closes a group when the next action starts after a member has
    ended or its rank is already in it."""
    groups: list[list[RankAction]] = []
    group: list[RankAction] = []
    ends: list[float] = []
    for (start, end), ra in sorted(members, key=lambda m: (m[0][0], m[1][0])):
        if group and (start >= min(ends) or ra[0] in {r for r, _ in group}):
            groups.append(group)
            group, ends = [], []
        group.append(ra)
        ends.append(end)
    if group:
        groups.append(group)
    return groups


def _steps(timeline: Mapping[RankAction, Interval]) -> list[list[RankAction]]:
    """``concurrent`` groups of compute actions of one class (forward, backward)."""
    steps: list[list[RankAction]] = []
    for backward in (False, True):
        members = [
            (t, ra) for ra, t in timeline.items() if ra[1].kind is not Kind.W and ra[1].kind.is_backward == backward
        ]
        steps += concurrent(members)
    return steps


def plan_exchange(
    schedule: Schedule, lengths: Sequence[int], timeline: Optional[Mapping[RankAction, Interval]] = None
) -> ExchangePlan:
    """The pairing of a lowered ``schedule`` whose slices have ``lengths`` tokens, steps read from
    ``timeline`` ((start, end) of every compute action; default: ``unit_timeline``). No deadlock check."""
    if len(lengths) != schedule.num_slices:
        raise ValueError(f"exchange: {len(lengths)} slice lengths for {schedule.num_slices} slices")
    if not schedule.is_lowered:
        raise ValueError("exchange: pair the lowered schedule (schedule.lower.lower), the one ranks execute")
    prefixes = [0, *accumulate(lengths)][:-1]
    timeline = timeline if timeline is not None else unit_timeline(schedule)
    steps = sorted(_steps(timeline), key=lambda g: (timeline[g[0]][0], g[0][1].kind.is_backward))
    pairs = [p for i, group in enumerate(steps) for p in _pair_step(i, group, lengths, prefixes, timeline)]
    return ExchangePlan(tuple(sorted(pairs)))


def drop_deadlocks(schedule: Schedule) -> Schedule:
    """``schedule`` without the blocks its ranks cannot run: each pass walks it, and a block with
    an end where a rank got stuck is dropped (``ExchangePlan.without``), until the walk completes
    or no block blocks it."""
    while schedule.exchange:
        walker = Walker(schedule)
        stuck = {(r, schedule.ranks[r][i]) for r, i in walker.run(lambda rank, a, ready: 0.0).items()}
        plan = walker.exchange
        blocking = {b for b in plan.blocks if b.sender_end in stuck or b.taker_end in stuck}
        if not blocking:
            return schedule  # done, or stuck for another reason (the validator reports it)
        schedule = dataclasses.replace(schedule, exchange=plan.without(blocking).to_text())
    return schedule


def with_exchange(
    schedule: Schedule, lengths: Sequence[int], timeline: Optional[Mapping[RankAction, Interval]] = None
) -> Schedule:
    """``schedule`` (lowered) carrying its deadlock-free context-exchange pairing."""
    plan = plan_exchange(schedule, lengths, timeline)
    return drop_deadlocks(dataclasses.replace(schedule, exchange=plan.to_text()))
