"""Branch and bound over the candidates of one schedule family.

Candidates the product would refuse to launch (``runnable.py``: the start-up rules of
``megatron-args`` and the launcher) are dropped first, so the choice is always a plan that runs.
Candidates whose schedule-free memory bound (``first_backward_memory``) exceeds the cap are
dropped; the rest are taken best time estimate first (``bounds.time_bounds``: a cheap form for
all, refined to every stage when a candidate comes up). In that order each is checked against the
cap with ``memory_lower_bound`` (the simulator's memory accounting on the generated schedule) and,
if it fits, simulated exactly as ``megatron-slim simulate`` does (context exchange with the group
plan that simulate prices and train runs). The search stops when no candidate left has a time
lower bound below the fastest simulated fit (nothing later can win). With a budget
(``max_simulations``) it also stops after that many simulations (a context-exchange candidate
counts as the ``1 + GROUP_ROUNDS`` it runs, and is skipped when they would overrun the budget), or
once the next estimate is no better than the fastest simulated fit; ``None``: no budget, the exact
optimum of the candidates. Everything is
deterministic: ties break on the candidate's fields.
"""

from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass
from typing import Optional

from megatron_slim.plan.cost.calibration import Calibration
from megatron_slim.plan.cost.model import CostModel
from megatron_slim.plan.hardware import HardwareProfile
from megatron_slim.plan.progress import Progress, report
from megatron_slim.plan.recipe import Recipe
from megatron_slim.plan.schedule.generators import generate
from megatron_slim.plan.schedule.ir import Schedule
from megatron_slim.plan.schema import ConfigError
from megatron_slim.plan.sim.costs import RecipeCosts
from megatron_slim.plan.sim.exchange_timing import GROUP_ROUNDS, simulate_as_planned
from megatron_slim.plan.tune.bounds import TimeBounds, first_backward_memory, memory_lower_bound, time_bounds
from megatron_slim.plan.tune.runnable import LAUNCH_CALLERS, Runnable
from megatron_slim.plan.tune.space import Candidate, candidate_recipe

DEFAULT_MAX_SIMULATIONS = 4
Ranked = tuple[TimeBounds, Candidate, RecipeCosts]


@dataclass(frozen=True)
class Evaluated:
    """A simulated candidate."""

    candidate: Candidate
    recipe: Recipe
    iteration_time_s: float
    mfu: float
    bubble_ratio: float
    peak_memory_bytes: float

    @property
    def label(self) -> str:
        return self.candidate.label


@dataclass(frozen=True)
class Smallest:
    """The smallest peak memory the search saw, and whether it was simulated or only bounded."""

    peak_bytes: float
    label: str
    simulated: bool


@dataclass(frozen=True)
class FamilyResult:
    best: Optional[Evaluated]
    cap_bytes: float
    candidates: int
    simulated: int
    memory_pruned: int
    smallest: Optional[Smallest]
    refused: dict[str, int] = dataclasses.field(default_factory=dict)  # candidates a start-up rule refuses, by rule


def costs_of(recipe: Recipe, hardware: HardwareProfile, calibration: Optional[Calibration] = None) -> RecipeCosts:
    return RecipeCosts(recipe, CostModel(recipe, hardware=hardware, calibration=calibration))


def evaluate(
    candidate: Candidate, costs: RecipeCosts, schedule: Schedule, progress: Optional[Progress] = None
) -> Evaluated:
    """The figures ``megatron-slim simulate`` prints for the candidate (exchange: its group plan)."""
    result = simulate_as_planned(schedule, costs, progress)
    peak = max(r.peak_memory_bytes for r in result.ranks)
    return Evaluated(candidate, costs.recipe, result.iteration_time_s, result.mfu, result.bubble_ratio, peak)


def simulations_of(recipe: Recipe) -> int:
    """Simulations one evaluation runs: a context-exchange plan is re-planned ``GROUP_ROUNDS`` times."""
    s = recipe.schedule
    return 1 + GROUP_ROUNDS if s.kind == "slimpipe" and s.slice_policy == "exchange" and recipe.parallel.pp > 1 else 1


def schedule_of(recipe: Recipe, shapes: dict[tuple[str, int, int, int, int], Schedule]) -> Schedule:
    """The generated (compute-only) schedule, generated once per shape within one search."""
    p, s = recipe.parallel, recipe.schedule
    key = (s.kind, p.pp, p.vpp, recipe.num_microbatches, s.num_slices)
    if key not in shapes:
        shapes[key] = generate(*key)
    return shapes[key]


def ranked(
    base: Recipe,
    cands: list[Candidate],
    cap: float,
    calibration: Optional[Calibration] = None,
    runnable: Optional[Runnable] = None,
    progress: Optional[Progress] = None,
) -> tuple[list[Ranked], list[tuple[float, Candidate]]]:
    """Candidates that run as launched (``runnable``: all by default) and may fit, with their cheap
    time bounds; and the (memory lower bound, candidate) of those that cannot fit."""
    hardware = base.hardware_profile
    out, too_big = [], []
    floors: dict[Candidate, float] = {}  # exchange keeps uniform slices' memory: one floor for both
    for index, c in enumerate(cands):
        report(progress, "bounding candidates", index, len(cands))
        try:
            recipe = candidate_recipe(base, c)
        except ConfigError:  # a choice a recipe rule refuses (the space only enumerates valid ones today)
            continue
        if runnable is not None and runnable.refusal(recipe) is not None:
            continue
        costs = costs_of(recipe, hardware, calibration)
        twin = dataclasses.replace(c, slice_policy="uniform") if c.slice_policy == "exchange" else c
        floor = floors.get(twin)
        if floor is None:
            floor = floors[twin] = first_backward_memory(costs)
        if floor > cap:
            too_big.append((floor, c))
        else:
            out.append((time_bounds(costs), c, costs))
    return out, too_big


class _Queue:
    """Candidates best estimate first, each one's bounds refined to ``every_stage`` the first time it
    comes up (refining only raises them, so it goes back in line); ``floor()``: the lowest time
    lower bound of everything still queued."""

    def __init__(self, entries: list[Ranked]) -> None:
        self.heap = [(b.estimate, c, False) for b, c, _ in entries]
        heapq.heapify(self.heap)
        self.info = {c: (b, costs) for b, c, costs in entries}

    def pop(self) -> Optional[tuple[TimeBounds, Candidate, RecipeCosts]]:
        while self.heap:
            _, c, refined = heapq.heappop(self.heap)
            bounds, costs = self.info[c]
            if refined:
                return bounds, c, costs
            bounds = time_bounds(costs, every_stage=True)
            self.info[c] = (bounds, costs)
            heapq.heappush(self.heap, (bounds.estimate, c, True))
        return None

    def floor(self) -> float:
        return min((self.info[c][0].lower for _, c, _ in self.heap), default=float("inf"))


class _Best:
    """The fastest fit so far and the smallest peak seen among what does not fit."""

    def __init__(self) -> None:
        self.fit: Optional[Evaluated] = None
        self.smallest: Optional[Smallest] = None

    def too_big(self, peak: float, c: Candidate, simulated: bool) -> None:
        if self.smallest is None or (peak, c.label) < (self.smallest.peak_bytes, self.smallest.label):
            self.smallest = Smallest(peak, c.label, simulated)

    def offer(self, run: Evaluated) -> None:
        if self.fit is None or (run.iteration_time_s, run.candidate) < (self.fit.iteration_time_s, self.fit.candidate):
            self.fit = run

    def beats(self, seconds: float) -> bool:
        return self.fit is not None and self.fit.iteration_time_s <= seconds


def search(
    base: Recipe,
    cands: list[Candidate],
    max_simulations: Optional[int] = DEFAULT_MAX_SIMULATIONS,
    calibration: Optional[Calibration] = None,
    callers: tuple[str, ...] = LAUNCH_CALLERS,
    progress: Optional[Progress] = None,
) -> FamilyResult:
    """The fastest fit among ``cands`` that the start-up rules of ``callers`` accept (``()``: all).
    ``progress`` hears ``("bounding candidates", i, n)``, then ``("simulating", k, budget)``."""
    cap = float(base.hardware_profile.usable_hbm_bytes)
    runnable = Runnable(callers)
    shapes: dict[tuple[str, int, int, int, int], Schedule] = {}
    best = _Best()
    candidates, too_big = ranked(base, cands, cap, calibration, runnable, progress)
    for floor, c in too_big:
        best.too_big(floor, c, simulated=False)
    simulated, pruned = 0, len(too_big)
    queue = _Queue(candidates)
    while (item := queue.pop()) is not None:
        bounds, c, costs = item
        if best.beats(min(bounds.lower, queue.floor())):
            break
        if max_simulations is not None and (simulated >= max_simulations or best.beats(bounds.estimate)):
            break
        runs = simulations_of(costs.recipe)
        if max_simulations is not None and simulated + runs > max_simulations:
            continue  # an exchange plan's simulations would overrun the budget
        schedule = schedule_of(costs.recipe, shapes)
        floor = memory_lower_bound(costs, schedule)
        if floor > cap:
            pruned += 1
            best.too_big(floor, c, simulated=False)
            continue
        budget = max_simulations if max_simulations is not None else len(cands)
        report(progress, "simulating", simulated, budget)
        run = evaluate(c, costs, schedule)
        simulated += runs
        if run.peak_memory_bytes > cap:
            best.too_big(run.peak_memory_bytes, c, simulated=True)
        else:
            best.offer(run)
    return FamilyResult(best.fit, cap, len(cands), simulated, pruned, best.smallest, dict(runnable.refused))
