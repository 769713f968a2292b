#!/usr/bin/env python
"""Probe: context exchange balancing whole time slots across both passes (not in the product;
figures in ``benchmarks/results/slimpipe_exchange.md``, section "2026-11-26, session 23").

    python benchmarks/slimpipe_exchange_crosspass.py [ROUNDS] [--vocab-parallel] [--mean-share]

Hypothesis: 1F1B's stagger puts a forward on some ranks and a backward (~2x the time) on others in
one unit-time slot, so balancing within one pass cannot equalise a slot. Here a *group* is every
compute action, of either pass, running at one moment (``slots``; on the unit-time timeline that
is one slot), and the group's members are given equal *whole* durations (water-filling,
``slimpipe_exchange_multiway.shares`` with ``--equal-time``): a member gives away at most its
movable attention (its slice's queries against its K/V prefix), so non-attention work (the output
layer on the last rank) is compensated by moving attention off that rank. A block keeps its
sender's pass: a forward block costs forward attention time on the taker, a backward block
backward attention time, whatever pass the taker is in. ``--mean-share``: each member's movable
attention becomes the group's mean instead (the earlier "idealised bound" rule, for comparison).

For each placement of the vocabulary (default; ``--vocab-parallel``: ``schedule.vocab_parallel``,
embedding and output layer spread over all ranks in the cost model):
1. uncoupled: the balanced durations alone, groups from unit time, then ``ROUNDS`` more rounds
   each reading the groups off the previous round's timeline;
2. coupled, transfers free and priced, for the groups of unit time and of every uncoupled round,
   under three rendezvous models (optimistic to pessimistic): ``GroupRun`` (the engine's pair
   model generalised to a group: each block as if it were the taker's first), ``SerialGroupRun``
   (a taker computes its blocks one after another) and ``StrictGroupRun`` (a sender waits for
   its takers' whole actions: blocks spread over the layers).
Also printed: blocks per group, senders per taker, and the largest one-layer working set a taker
holds (``ExchangeWork.peer_bytes`` summed over the blocks it serves in one group).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Mapping

sys.path.insert(0, str(Path(__file__).resolve().parent))

import slimpipe_exchange_multiway as mw  # noqa: E402

from megatron_slim.plan.recipe import load_recipe  # noqa: E402
from megatron_slim.plan.schedule.exchange import concurrent, unit_timeline  # noqa: E402
from megatron_slim.plan.schedule.exchange_blocks import RankAction  # noqa: E402
from megatron_slim.plan.schedule.generators import generate  # noqa: E402
from megatron_slim.plan.schedule.ir import Kind, Schedule  # noqa: E402
from megatron_slim.plan.schedule.lower import lower  # noqa: E402
from megatron_slim.plan.sim.engine import SimResult, compute_time, simulate  # noqa: E402

mw.EQUAL_TIME = "--mean-share" not in sys.argv  # whole durations equalised, or the movable mean
Interval = tuple[float, float]


def slots(timeline: Mapping[RankAction, Interval]) -> list[list[RankAction]]:
    """Compute actions of either pass on distinct ranks that all run at one moment
    (``exchange._steps`` without the split by pass)."""
    return concurrent([(t, ra) for ra, t in timeline.items() if ra[1].kind is not Kind.W])


def group_stats(costs: mw.BalancedCosts, schedule: Schedule, groups: list[list[RankAction]]) -> str:
    """The bubble if the groups ran in lock-step (each as long as its longest balanced member),
    blocks, mixed-pass groups, the most senders one taker serves, and its largest one-layer
    working set (the peer bytes of every block it holds while the group runs)."""
    blocks = mixed = most = 0
    peak = work = lockstep = 0.0
    for group in groups:
        fulls = [compute_time(costs, schedule.stage(r, a.chunk), a) for r, a in group]
        moves = [mw.movable(costs, schedule, ra) for ra in group]
        share = mw.shares(fulls, moves)
        work += sum(fulls)
        lockstep += max(f - m + s for f, m, s in zip(fulls, moves, share))
        senders = [(ra, m - s, m) for ra, m, s in zip(group, moves, share) if m > s + 1e-12]
        takers = [s - m for m, s in zip(moves, share) if s > m + 1e-12]
        mixed += len({a.kind.is_backward for _, a in group}) > 1
        blocks += len(senders) * len(takers)
        most = max(most, len(senders) if takers else 0)
        total = sum(e for _, e, _ in senders)
        for deficit in takers:
            held = 0.0
            for (rank, a), excess, mv in senders:
                tokens = max(1, int(costs.prefixes[a.slice] * excess * deficit / total / mv))
                stage = schedule.stage(rank, a.chunk)
                held += costs.exchange(stage, a.microbatch, a.slice, tokens, a.kind.is_backward).peer_bytes
            peak = max(peak, held)
    bubble = 1 - work / (schedule.pp * lockstep)
    return (
        f"lock-step {bubble:.2%}; {len(groups)} groups ({mixed} mixed-pass), {blocks} blocks, "
        f"<= {most} senders/taker, taker peak {peak / 2**30:.2f} GiB/layer"
    )


class StrictGroupRun(mw.GroupRun):
    """``GroupRun`` with a taker's blocks spread over its layers (per-layer rendezvous): a sender
    ends no earlier than every one of its takers has ended plus one layer's return transfer,
    instead of as if its block were the first the taker computes; the Q/K/V transfers pipeline
    layer by layer (a taker's last layer of a block waits for all its bytes, its first for one
    layer's). Link contention is not modelled (as in the engine)."""

    def _run_step(self, step: list[RankAction]) -> None:
        members = {}
        for rank, a in step:
            t = self.start(rank, a)
            assert t is not None
            stage = self.schedule.stage(rank, a.chunk)
            full = compute_time(self.costs, stage, a)
            members[(rank, a)] = (t, full, mw.movable(self.costs, self.schedule, (rank, a)))
        fulls, moves = [m[1] for m in members.values()], [m[2] for m in members.values()]
        share = dict(zip(members, mw.shares(fulls, moves)))
        senders = {ra: m[2] - share[ra] for ra, m in members.items() if m[2] > share[ra]}
        takers = {ra: share[ra] - m[2] for ra, m in members.items() if m[2] < share[ra]}
        total = sum(senders.values())
        ends = {ra: t + full - mv + share[ra] for ra, (t, full, mv) in members.items()}
        back_layer: dict[RankAction, float] = {}
        for ra, excess in senders.items():
            t, _, mv = members[ra]
            for peer, deficit in takers.items():
                block = excess * deficit / total
                over, back = self._comm(ra, mv, peer[0], block)
                layers = self.costs.cost.layers_per_stage  # transfers pipelined layer by layer
                ends[peer] = max(ends[peer], t + max(over + block / layers, over / layers + block))
                back_layer[ra] = max(back_layer.get(ra, 0.0), back / layers)
        for ra in senders:
            ends[ra] = max(ends[ra], max((ends[p] for p in takers), default=0.0) + back_layer.get(ra, 0.0))
        for ra, (t, full, mv) in members.items():
            self.run._record(ra[0], ra[1], t, ends[ra], full - mv + share[ra])
            self.walker._advance(ra[0], ra[1], ends[ra])


class SerialGroupRun(mw.GroupRun):
    """``GroupRun`` with each taker computing its blocks one after another (senders in start order,
    from the taker's start), whole-stage transfers as in the engine: block ``k`` of a taker starts
    at ``max(its previous block's end, sender start + over)``; its sender ends no earlier than the
    block's end plus ``back``."""

    def _run_step(self, step: list[RankAction]) -> None:
        members = {}
        for rank, a in step:
            t = self.start(rank, a)
            assert t is not None
            full = compute_time(self.costs, self.schedule.stage(rank, a.chunk), a)
            members[(rank, a)] = (t, full, mw.movable(self.costs, self.schedule, (rank, a)))
        share = dict(zip(members, mw.shares([m[1] for m in members.values()], [m[2] for m in members.values()])))
        senders = sorted((m[0], ra, m[2] - share[ra]) for ra, m in members.items() if m[2] > share[ra])
        takers = {ra: share[ra] - m[2] for ra, m in members.items() if m[2] < share[ra]}
        total = sum(e for _, _, e in senders)
        ends = {ra: t + full - mv + share[ra] for ra, (t, full, mv) in members.items()}
        cursor = {peer: members[peer][0] for peer in takers}
        for t, ra, excess in senders:
            for peer, deficit in takers.items():
                block = excess * deficit / total
                over, back = self._comm(ra, members[ra][2], peer[0], block)
                cursor[peer] = max(cursor[peer], t + over) + block
                ends[ra] = max(ends[ra], cursor[peer] + back)
                ends[peer] = max(ends[peer], cursor[peer])
        for ra, (t, full, mv) in members.items():
            self.run._record(ra[0], ra[1], t, ends[ra], full - mv + share[ra])
            self.walker._advance(ra[0], ra[1], ends[ra])


def busy(result: SimResult, rank: int) -> float:
    return sum(e.end - e.start for e in result.events if e.stream == "compute" and e.rank == rank)


def coupled(costs: mw.BalancedCosts, schedule: Schedule, groups: list[list[RankAction]], label: str) -> None:
    costs.durations = {}
    for model in (mw.GroupRun, SerialGroupRun, StrictGroupRun):
        figures = []
        for transfers in (False, True):
            run = model(schedule, costs, groups, transfers)
            bubble = run.simulate()
            figures.append(f"{bubble:.2%} ({max(run.run.free):.2f} s, {run.dissolved} unbalanced)")
        print(f"  coupled ({model.__name__}), groups from {label}: free {figures[0]}, priced {figures[1]}")


def probe(vocab_parallel: bool, rounds: int) -> None:
    sets = [*mw.SETS, f"schedule.vocab_parallel={'true' if vocab_parallel else 'false'}"]
    recipe = load_recipe("llama2-13b-128k", sets)
    costs = mw.BalancedCosts(recipe)
    p = recipe.parallel
    schedule = lower(generate(recipe.schedule.kind, p.pp, p.vpp, recipe.num_microbatches, recipe.schedule.num_slices))
    base = simulate(schedule, costs)
    figure = f"{base.bubble_ratio:.2%} ({base.pipeline_time_s:.2f} s)"
    print(f"vocab_parallel={vocab_parallel}: uniform, no exchange: bubble {figure}")
    timeline: Mapping[RankAction, Interval] = unit_timeline(schedule)
    for i in range(rounds + 1):
        label = "unit time" if i == 0 else f"uncoupled round {i}"
        groups = slots(timeline)
        costs.durations = {}
        stats = group_stats(costs, schedule, groups)
        mw.balance(costs, schedule, groups)
        result = simulate(schedule, costs)
        figure = f"{result.bubble_ratio:.2%} ({result.pipeline_time_s:.2f} s)"
        print(f"  uncoupled, groups from {label}: bubble {figure}; {stats}")
        print(f"    busy per rank (s): {' '.join(f'{busy(result, r):.2f}' for r in range(p.pp))}")
        coupled(costs, schedule, groups, label)
        timeline = mw.timeline(result)


if __name__ == "__main__":
    numbers = [a for a in sys.argv[1:] if a.isdigit()]
    probe("--vocab-parallel" in sys.argv, int(numbers[0]) if numbers else 2)
