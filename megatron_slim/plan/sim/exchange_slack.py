"""Context-exchange pairs chosen by idle time on a simulated timeline.

A pair shortens its sender by the moved block and lengthens its peer by it, and the sender cannot
finish before the block's result is back (``engine.py``'s pair formula). So a pair pays only where
the peer's rank would otherwise idle after the peer's action and the sender is on the critical
path. On a simulated timeline each compute action has a *deadline*: the latest end that delays
nothing (its rank's next action, and the stage that consumes its output, less the transfer). Here
every unpaired action with room before its deadline is a candidate peer; every unpaired action of
the same pass (forward with forward, backward with backward) on another rank that runs during that
room is a candidate sender, with every whole-slice moved volume its prefix allows. A candidate
counts what it takes off the sender's end (priced by the engine's formula, transfers included)
where nothing already waits later for the sender, and only if the peer still ends by its deadline.
The best candidates are taken greedily, each action in at most one pair. ``losing_pairs`` names
the pairs of a timeline whose sender gained nothing (it waited for its peer or the transfers at
least as long as the block it moved), which only lengthen their peer.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from itertools import accumulate
from typing import Sequence, cast

from megatron_slim.plan.schedule.exchange_blocks import ExchangeBlock, ExchangePlan, RankAction
from megatron_slim.plan.schedule.ir import Action, Kind, Schedule
from megatron_slim.plan.sim.costs import ExchangeCosts, PipelineCosts
from megatron_slim.plan.sim.engine import SimResult, compute_time

MIN_GAIN_S = 1e-5  # a pair saving less than this is not worth its messages


@dataclass(frozen=True)
class Timed:
    start: float
    end: float
    deadline: float  # the latest end that delays no other action


def _consumer(schedule: Schedule, rank: int, a: Action) -> RankAction | None:
    """The compute action on the next stage (forward) or the previous one (backward) that reads ``a``'s output."""
    stage = schedule.stage(rank, a.chunk)
    other = stage + 1 if a.kind is Kind.F else stage - 1
    if a.kind is Kind.W or not 0 <= other < schedule.pp * schedule.vpp:
        return None
    r, chunk = schedule.placement(other)
    return r, Action(a.kind, chunk, a.microbatch, a.slice)


def timed_actions(result: SimResult, costs: PipelineCosts) -> dict[RankAction, Timed]:
    """Every compute action of ``result`` with its (start, end, deadline)."""
    schedule = result.schedule
    spans = {(e.rank, Action.parse(e.name)): (e.start, e.end) for e in result.events if e.stream == "compute"}
    next_start: dict[RankAction, float] = {}
    for rank in range(schedule.pp):
        mine = sorted((span[0], ra) for ra, span in spans.items() if ra[0] == rank)
        starts = [s for s, _ in mine[1:]] + [result.pipeline_time_s]
        next_start.update((ra, s) for (_, ra), s in zip(mine, starts))
    timed = {}
    for (rank, a), (start, end) in spans.items():
        deadline = next_start[(rank, a)]
        consumer = _consumer(schedule, rank, a)
        if consumer not in spans and consumer is not None and a.kind is Kind.B:
            consumer = consumer[0], consumer[1].with_kind(Kind.I)
        if consumer in spans and consumer is not None:
            stage = schedule.stage(rank, a.chunk)
            link = costs.link(rank, consumer[0])
            nbytes = costs.p2p_bytes(min(stage, schedule.stage(consumer[0], consumer[1].chunk)), a.microbatch, a.slice)
            deadline = min(deadline, spans[consumer][0] - nbytes / link.bandwidth - link.latency)
        timed[(rank, a)] = Timed(start, end, max(deadline, end))
    return timed


def _paired_ends(
    schedule: Schedule, costs: PipelineCosts, sender: RankAction, s: Timed, peer: RankAction, p: Timed, moved: int
) -> tuple[float, float]:
    """(sender end, peer end) if the two unpaired actions pair with ``moved`` tokens (``engine._Run._pair``)."""
    (rank, a), (p_rank, _) = sender, peer
    work = cast(ExchangeCosts, costs).exchange(
        schedule.stage(rank, a.chunk), a.microbatch, a.slice, moved, a.kind.is_backward
    )
    link = costs.link(rank, p_rank)
    over = work.out_bytes / link.bandwidth + work.messages * link.latency
    back = work.back_bytes / link.bandwidth + work.messages * link.latency
    p_end = max(p.end + work.block_s, s.start + over + work.block_s)
    end = max(s.end - work.block_s, max(p.start, s.start + over) + work.block_s + back)
    return end, p_end


def _best_move(
    schedule: Schedule,
    costs: PipelineCosts,
    prefixes: Sequence[int],
    sender: RankAction,
    s: Timed,
    peer: RankAction,
    p: Timed,
) -> tuple[float, int]:
    """(useful gain, moved tokens) of the best whole-slice move from ``sender`` to ``peer`` (gain 0: none)."""
    best = (0.0, 0)
    waited = s.deadline - s.end  # the sender's own room: shortening it by this much helps nobody
    for moved in prefixes[1 : sender[1].slice + 1]:
        end, p_end = _paired_ends(schedule, costs, sender, s, peer, p, moved)
        if p_end > p.deadline:
            break  # more moved work only ends the peer later
        gain = s.end - end - waited
        if gain > best[0]:
            best = (gain, moved)
    return best


def _candidates(
    schedule: Schedule, costs: PipelineCosts, prefixes: Sequence[int], timed: dict[RankAction, Timed]
) -> list[tuple[float, RankAction, RankAction, int]]:
    """(gain, sender, peer, moved) of every pair worth forming among the actions of ``timed``."""
    by_rank: dict[tuple[int, bool], list[tuple[float, RankAction]]] = {}
    for ra, t in timed.items():
        if ra[1].kind is not Kind.W and ra[1].slice > 0:
            by_rank.setdefault((ra[0], ra[1].kind.is_backward), []).append((t.start, ra))
    for members in by_rank.values():
        members.sort()
    longest = max((t.end - t.start for t in timed.values()), default=0.0)
    found = []
    for peer, p in timed.items():
        if peer[1].kind is Kind.W or p.deadline - p.end <= MIN_GAIN_S:
            continue
        for rank in range(schedule.pp):
            members = by_rank.get((rank, peer[1].kind.is_backward), [])
            if rank == peer[0] or not members:
                continue
            lo = bisect.bisect_left(members, (p.start - longest,))
            hi = bisect.bisect_left(members, (p.deadline,))
            for _, sender in members[lo:hi]:
                s = timed[sender]
                if s.end <= p.start:
                    continue
                gain, moved = _best_move(schedule, costs, prefixes, sender, s, peer, p)
                if gain > MIN_GAIN_S:
                    found.append((gain, sender, peer, moved))
    return found


def slack_pairs(
    result: SimResult, costs: PipelineCosts, lengths: Sequence[int], step: int, taken: ExchangePlan
) -> list[ExchangeBlock]:
    """New pairs among the actions of ``result`` that no pair of ``taken`` holds (``step``: their round)."""
    prefixes = [0, *accumulate(lengths)]
    timed = {ra: t for ra, t in timed_actions(result, costs).items() if not taken.group_of(*ra)}
    used: set[RankAction] = set()
    pairs = []
    for _gain, sender, peer, moved in sorted(_candidates(result.schedule, costs, prefixes, timed), reverse=True):
        if sender in used or peer in used:
            continue
        used |= {sender, peer}
        pairs.append(ExchangeBlock(step, sender[0], sender[1], peer[0], peer[1], 0, moved))
    return pairs


def losing_pairs(result: SimResult, costs: PipelineCosts) -> set[ExchangeBlock]:
    """The pairs of ``result`` whose sender took at least as long as it would have unpaired: they
    only lengthen their peer."""
    schedule = result.schedule
    spans = {(e.rank, e.name): e.end - e.start for e in result.events if e.stream == "compute"}
    return {
        p
        for p in ExchangePlan.from_text(schedule.exchange).blocks
        if spans[(p.sender, str(p.sender_action))]
        >= compute_time(costs, schedule.stage(p.sender, p.sender_action.chunk), p.sender_action)
    }
