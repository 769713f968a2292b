"""Solvers over ``StageLoads``: the exact repartition, DynMo's diffusion variant for comparison, and
the cost-benefit trigger that says whether moving layers pays for itself."""

from __future__ import annotations

import itertools
import math
from typing import Optional

from megatron_slim.plan.dynmo.partition import Partition, StageLoads

_INF = math.inf


def repartition(loads: StageLoads, memory_cap: float, current: Optional[Partition] = None) -> Partition:
    """The split with the smallest slowest-stage time over ``len(loads.in_flight)`` non-empty
    stages, each within ``memory_cap`` bytes; ties go to the fewest layers moved from ``current``
    (Megatron's even split when none). Raises ``ValueError`` when no split fits the cap."""
    num_layers, num_stages = len(loads.layers), len(loads.in_flight)
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"repartition: {num_stages} stages for {num_layers} layers; allowed: 1 to {num_layers} stages")
    reference = current if current is not None else Partition.even(num_layers, num_stages)
    if reference.num_layers != num_layers or reference.num_stages != num_stages:
        raise ValueError(
            f"repartition: current split {reference.layers_per_stage} is not one of {num_layers} layers "
            f"over {num_stages} stages"
        )
    ranges = _Ranges(loads, memory_cap)
    best = _min_max(ranges, num_layers, num_stages)
    if best == _INF:
        raise ValueError(
            f"repartition: no split of {num_layers} layers over {num_stages} stages fits "
            f"memory_cap={memory_cap:.4g} bytes; "
            f"the smallest possible largest stage is {_min_max_memory(loads, num_stages):.4g} bytes"
        )
    return _fewest_moves(ranges, num_layers, num_stages, best * (1 + 1e-12), reference)


class _Ranges:
    """O(1) time and memory of stage ``s`` holding layers ``[start, end)``, from prefix sums."""

    def __init__(self, loads: StageLoads, memory_cap: float) -> None:
        self.loads, self.cap = loads, memory_cap
        self.time = list(itertools.accumulate((c.time_s for c in loads.layers), initial=0.0))
        self.static = list(itertools.accumulate((c.static_bytes for c in loads.layers), initial=0.0))
        self.act = list(itertools.accumulate((c.activation_bytes for c in loads.layers), initial=0.0))
        self.last = len(loads.in_flight) - 1

    def cost(self, stage: int, start: int, end: int) -> float:
        """The stage's time, or infinity when it would exceed the memory cap."""
        e = self.loads.extras
        memory = self.static[end] - self.static[start] + self.loads.in_flight[stage] * (self.act[end] - self.act[start])
        memory += (e.first_bytes if stage == 0 else 0.0) + (e.last_bytes if stage == self.last else 0.0)
        if memory > self.cap:
            return _INF
        t = self.time[end] - self.time[start]
        return t + (e.first_s if stage == 0 else 0.0) + (e.last_s if stage == self.last else 0.0)


def _min_max(ranges: _Ranges, num_layers: int, num_stages: int) -> float:
    """best[i]: smallest slowest stage over splits of the first i layers into the stages so far."""
    best = [0.0] + [_INF] * num_layers
    for s in range(num_stages):
        nxt = [_INF] * (num_layers + 1)
        for end in range(s + 1, num_layers - (num_stages - 1 - s) + 1):
            nxt[end] = min(
                (max(best[start], ranges.cost(s, start, end)) for start in range(s, end) if best[start] < _INF),
                default=_INF,
            )
        best = nxt
    return best[num_layers]


def _fewest_moves(ranges: _Ranges, num_layers: int, num_stages: int, bound: float, reference: Partition) -> Partition:
    """Among splits whose every stage costs at most ``bound``: the one closest to ``reference``."""
    was = reference.stage_of_layer()
    kept = [list(itertools.accumulate((w == s for w in was), initial=0)) for s in range(num_stages)]
    moves = [0] + [num_layers + 1] * num_layers  # moves[i]: fewest moved among the first i layers
    choice: list[list[int]] = []
    for s in range(num_stages):
        nxt, start_of = [num_layers + 1] * (num_layers + 1), [-1] * (num_layers + 1)
        for end in range(s + 1, num_layers - (num_stages - 1 - s) + 1):
            for start in range(s, end):
                if moves[start] > num_layers or ranges.cost(s, start, end) > bound:
                    continue
                moved = moves[start] + (end - start) - (kept[s][end] - kept[s][start])
                if moved < nxt[end]:
                    nxt[end], start_of[end] = moved, start
        moves = nxt
        choice.append(start_of)
    counts, end = [], num_layers
    for s in range(num_stages - 1, -1, -1):
        start = choice[s][end]
        counts.append(end - start)
        end = start
    return Partition(tuple(reversed(counts)))


def _min_max_memory(loads: StageLoads, num_stages: int) -> float:
    """Smallest achievable largest stage memory (for the error message when nothing fits)."""
    n = len(loads.layers)
    best = [0.0] + [_INF] * n
    for s in range(num_stages):
        best = [_INF] * (s + 1) + [
            min(max(best[a], loads.memory_bytes(s, a, e)) for a in range(s, e)) for e in range(s + 1, n + 1)
        ]
    return best[n]


def diffuse(loads: StageLoads, memory_cap: float, current: Partition, max_rounds: int = 1000) -> Partition:
    """DynMo's diffusion balancer, restricted to neighbours so layer order holds: the slowest stage
    hands its first layer to the previous stage or its last to the next, whichever lowers the
    slower of the two more, while the receiver stays within the cap and the giver keeps a layer.
    Greedy: stops at a local optimum, which ``repartition`` is measured against."""
    counts = list(current.layers_per_stage)
    for _ in range(max_rounds):
        times = loads.stage_times(Partition(tuple(counts)))
        slowest = max(range(len(counts)), key=times.__getitem__)
        options = []
        for peer in (slowest - 1, slowest + 1):
            if 0 <= peer < len(counts) and counts[slowest] > 1:
                trial = counts[:]
                trial[slowest] -= 1
                trial[peer] += 1
                candidate = Partition(tuple(trial))
                if loads.stage_memory(candidate)[peer] <= memory_cap:
                    new_times = loads.stage_times(candidate)
                    options.append((max(new_times[slowest], new_times[peer]), trial))
        if not options or min(options)[0] >= times[slowest]:
            break
        counts = min(options)[1]
    return Partition(tuple(counts))


def pipeline_step_s(stage_times: list[float], num_units: int) -> float:
    """A pipeline step's length when each stage takes ``stage_times[s]`` per unit (forward and
    backward): the critical path of a 1F1B ladder, fill and drain through every stage once plus
    ``num_units - 1`` more turns of the slowest stage."""
    return sum(stage_times) + (num_units - 1) * max(stage_times)


def worth_migrating(step_now_s: float, step_after_s: float, steps_until_next_change: int, migration_s: float) -> bool:
    """Move layers only when the time saved before the model changes again exceeds the move's cost."""
    return (step_now_s - step_after_s) * steps_until_next_change > migration_s


def migration_bytes(loads: StageLoads, current: Partition, target: Partition) -> float:
    """State that moves: each moved layer's static bytes (weights, gradients, optimizer state)."""
    was, now = current.stage_of_layer(), target.stage_of_layer()
    return sum(c.static_bytes for c, a, b in zip(loads.layers, was, now) if a != b)
