#!/usr/bin/env python
"""Probe: multi-way context exchange in the simulator (not in the product; figures in
``benchmarks/results/slimpipe_exchange.md``, section 2026-11-26 "multi-way balancing probe").

    python benchmarks/slimpipe_exchange_multiway.py [IDEAL_ROUNDS] [--equal-time]

On the 13B-class 256K config of issue 9 (t1 c8 p8 v5 n16, 8 microbatches, uniform slices) every
step (``schedule/exchange.py``'s ``_steps``: compute actions of one pass on distinct ranks running
at one moment of a timeline) shares its movable attention equally: each member's prefix block
(its slice's queries against its whole K/V prefix) is replaced by the step's mean, so every rank's
action in a step gets equal work. Today's pairing cannot express it: an action exchanges with
several peers (senders split their excess over all takers in proportion to their deficits).

1. *Uncoupled*: the balanced durations alone (no rendezvous, transfers free), steps read first from
   the unit-time timeline, then from the previous round's simulated one (``IDEAL_ROUNDS`` rounds).
2. *Coupled*: steps from the last uncoupled timeline, simulated event by event with the engine's
   pair model generalised to a group (``engine.py``: a block starts once both ends have started and
   its sender's Q and K/V have crossed; the sender ends no earlier than each block's result is
   back), once with transfers free and once priced over the PP links. A step whose rendezvous
   deadlocks under the send windows runs unbalanced. Time figures only; memory is not modelled.
A probe: it drives the simulator's internals (``engine._Run``, ``Walker._advance``), not an API.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Mapping

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_slim.plan.recipe import Recipe, load_recipe  # noqa: E402
from megatron_slim.plan.schedule.exchange import _steps, unit_timeline  # noqa: E402
from megatron_slim.plan.schedule.exchange_blocks import RankAction  # noqa: E402
from megatron_slim.plan.schedule.generators import generate  # noqa: E402
from megatron_slim.plan.schedule.ir import Action, Schedule  # noqa: E402
from megatron_slim.plan.schedule.lower import lower  # noqa: E402
from megatron_slim.plan.schedule.walk import Walker, bounded_sends  # noqa: E402
from megatron_slim.plan.sim.costs import RecipeCosts  # noqa: E402
from megatron_slim.plan.sim.engine import SimResult, _Run, compute_time, simulate  # noqa: E402

SETS = [
    *("parallel.tp=1", "parallel.sequence_parallel=false", "parallel.cp=8", "parallel.pp=8", "parallel.vpp=5"),
    *("schedule.num_slices=16", "model.seq_length=262144", "train.global_batch_size=8", "parallel.dp=1"),
    "schedule.slice_policy=exchange",
]
Timeline = Mapping[RankAction, tuple[float, float]]


class BalancedCosts(RecipeCosts):
    """``RecipeCosts`` with some compute durations replaced: ``(backward, stage, mb, slice) -> s``."""

    def __init__(self, recipe: Recipe) -> None:
        super().__init__(recipe)
        self.durations: dict[tuple[bool, int, int, int], float] = {}

    def forward(self, stage: int, microbatch: int, slice_: int) -> float:
        found = self.durations.get((False, stage, microbatch, slice_))
        return super().forward(stage, microbatch, slice_) if found is None else found

    def backward(self, stage: int, microbatch: int, slice_: int) -> float:
        found = self.durations.get((True, stage, microbatch, slice_))
        return super().backward(stage, microbatch, slice_) if found is None else found


def movable(costs: RecipeCosts, schedule: Schedule, ra: RankAction) -> float:
    """Seconds of ``ra``'s attention against its K/V prefix: what exchange can move away."""
    rank, a = ra
    prefix = costs.prefixes[a.slice]
    if prefix == 0:
        return 0.0
    return costs.exchange(schedule.stage(rank, a.chunk), a.microbatch, a.slice, prefix, a.kind.is_backward).block_s


def timeline(result: SimResult) -> dict[RankAction, tuple[float, float]]:
    return {(e.rank, Action.parse(e.name)): (e.start, e.end) for e in result.events if e.stream == "compute"}


EQUAL_TIME = "--equal-time" in sys.argv


def shares(fulls: list[float], moves: list[float]) -> list[float]:
    """The movable time each step member ends up with: the mean, or with ``--equal-time`` what
    makes the members' whole durations equal (water-filling, never below zero)."""
    if not EQUAL_TIME:
        return [sum(moves) / len(moves)] * len(moves)
    bases = sorted(f - m for f, m in zip(fulls, moves))
    total, level = sum(moves), 0.0
    for k in range(len(bases), 0, -1):  # the lowest k bases take all the movable time
        level = (total + sum(bases[:k])) / k
        if level >= bases[k - 1]:
            break
    return [max(0.0, level - (f - m)) for f, m in zip(fulls, moves)]


def balance(costs: BalancedCosts, schedule: Schedule, steps: list[list[RankAction]]) -> None:
    """Each step member's movable time becomes its ``shares`` (uncoupled, transfers free)."""
    costs.durations = {}
    for step in steps:
        stages = [schedule.stage(rank, a.chunk) for rank, a in step]
        fulls = [compute_time(costs, st, a) for st, (_, a) in zip(stages, step)]
        moves = [movable(costs, schedule, ra) for ra in step]
        for (_, a), st, full, mv, share in zip(step, stages, fulls, moves, shares(fulls, moves)):
            costs.durations[(a.kind.is_backward, st, a.microbatch, a.slice)] = full - mv + share


class GroupRun:
    """The coupled multi-way simulation (see the module docstring), timing only."""

    def __init__(self, schedule: Schedule, costs: RecipeCosts, steps: list[list[RankAction]], transfers: bool):
        self.schedule, self.costs, self.steps, self.transfers = schedule, costs, steps, transfers
        self.step_of = {ra: i for i, step in enumerate(steps) for ra in step if len(step) > 1}
        self.run = _Run(schedule, costs)
        self.walker = Walker(schedule)
        kept = bounded_sends(schedule)
        self.walker.window = {k: v for k, v in self.walker.window.items() if k in kept}
        self.dissolved = 0

    def head(self, rank: int) -> Action | None:
        row = self.schedule.ranks[rank]
        return row[self.walker.pos[rank]] if self.walker.pos[rank] < len(row) else None

    def start(self, rank: int, a: Action) -> float | None:
        ready = self.walker.ready_time(rank, a)
        return None if ready is None else max(self.run.free[rank], ready)

    def _next(self) -> tuple[float, int, Action, int | None] | None:
        """The runnable rank head (or whole step) that starts first."""
        best = None
        for rank in range(self.schedule.pp):
            a = self.head(rank)
            t = None if a is None else self.start(rank, a)
            if a is None or t is None:
                continue
            step = self.step_of.get((rank, a)) if a.kind.is_compute else None
            if step is not None:
                starts = [self.start(r, m) if self.head(r) == m else None for r, m in self.steps[step]]
                if None in starts:
                    continue
                t = max(s for s in starts if s is not None)
            if best is None or t < best[0]:
                best = (t, rank, a, step)
        return best

    def simulate(self) -> float:
        """Runs the schedule; returns the bubble."""
        while True:
            found = self._next()
            if found is None:
                stuck = {self.step_of.get((r, a)) for r in range(self.schedule.pp) if (a := self.head(r))}
                if not stuck - {None}:
                    break
                for step in stuck - {None}:  # its rendezvous deadlocks: run it unbalanced
                    for ra in self.steps[step]:
                        self.step_of.pop(ra, None)
                    self.dissolved += 1
                continue
            _, rank, a, step = found
            if step is None:
                ready = self.walker.ready_time(rank, a)
                assert ready is not None
                self.walker._advance(rank, a, self.run._step(rank, a, ready))
            else:
                self._run_step(self.steps[step])
        assert all(self.head(r) is None for r in range(self.schedule.pp)), "stalled"
        end = max(self.run.free)
        return 1.0 - sum(self.run.busy) / (self.schedule.pp * end)

    def _comm(self, sender: RankAction, mv: float, peer: int, block: float) -> tuple[float, float]:
        """(over, back) seconds of a block of ``block`` s of ``sender``'s ``mv`` s movable time."""
        if not self.transfers:
            return 0.0, 0.0
        rank, a = sender
        tokens = max(1, int(self.costs.prefixes[a.slice] * block / mv))
        stage = self.schedule.stage(rank, a.chunk)
        work = self.costs.exchange(stage, a.microbatch, a.slice, tokens, a.kind.is_backward)
        link = self.costs.link(rank, peer)
        lat = work.messages * link.latency
        return work.out_bytes / link.bandwidth + lat, work.back_bytes / link.bandwidth + lat

    def _run_step(self, step: list[RankAction]) -> None:
        members = []
        for rank, a in step:
            t = self.start(rank, a)
            assert t is not None
            stage = self.schedule.stage(rank, a.chunk)
            full, mv = compute_time(self.costs, stage, a), movable(self.costs, self.schedule, (rank, a))
            members.append(((rank, a), t, full, mv))
        share = dict(zip((m[0] for m in members), shares([m[2] for m in members], [m[3] for m in members])))
        takers = [(m, share[m[0]] - m[3]) for m in members if m[3] < share[m[0]]]
        senders = [(m, m[3] - share[m[0]]) for m in members if m[3] > share[m[0]]]
        total = sum(e for _, e in senders)
        ends = {m[0]: m[1] + m[2] - m[3] + share[m[0]] for m in members}
        for (ra, t, _, mv), excess in senders:
            for (peer, p_t, _, _), deficit in takers:
                block = excess * deficit / total
                over, back = self._comm(ra, mv, peer[0], block)
                ends[ra] = max(ends[ra], max(p_t, t + over) + block + back)
                ends[peer] = max(ends[peer], t + over + block)
        for ra, t, full, mv in members:
            busy = full - mv + share[ra]
            self.run._record(ra[0], ra[1], t, ends[ra], busy)
            self.walker._advance(ra[0], ra[1], ends[ra])


def main(ideal_rounds: int) -> None:
    recipe = load_recipe("llama2-13b-128k", SETS)
    costs = BalancedCosts(recipe)
    p = recipe.parallel
    schedule = lower(generate(recipe.schedule.kind, p.pp, p.vpp, recipe.num_microbatches, recipe.schedule.num_slices))
    print(f"uniform, no exchange: bubble {simulate(schedule, costs).bubble_ratio:.2%}")
    steps_from: Timeline = unit_timeline(schedule)
    for i in range(ideal_rounds):
        steps = _steps(steps_from)
        balance(costs, schedule, steps)
        result = simulate(schedule, costs)
        steps_from = timeline(result)
        source = "unit time" if i == 0 else "the previous round"
        print(f"uncoupled, steps from {source}: bubble {result.bubble_ratio:.2%}")
    costs.durations = {}
    steps = _steps(steps_from)
    for transfers in (False, True):
        run = GroupRun(schedule, costs, steps, transfers)
        bubble = run.simulate()
        label = "priced" if transfers else "free"
        print(f"coupled, transfers {label}: bubble {bubble:.2%} ({len(steps)} steps, {run.dissolved} run unbalanced)")


if __name__ == "__main__":
    rounds = [a for a in sys.argv[1:] if a.isdigit()]
    main(int(rounds[0]) if rounds else 2)
