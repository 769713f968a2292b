"""Cheap bounds that let the tuner skip simulations without changing its answer.

``time_bounds(...).lower`` never exceeds the simulated iteration time: rank ``r`` computes its busy time
one action after another; its first forward waits for the first forward of stages ``0 .. r-1``
(each on another rank), and after its last backward the backwards of stages ``r-1 .. 0`` still
run; gradient sync and the optimizer follow the pipeline. Communication only adds. For one chunk
and one slice this is the 1F1B closed form ``(m + p - 1)(f + b)``; with slices and chunks it is the
SlimPipe one, the cheapest slice's forward and backward in place of the average. Under context
exchange (attention moved between ranks) the ranks' mean takes the place of the slowest rank.

``first_backward_memory`` is a cruder memory bound that needs no schedule: when a rank runs its first
backward, every slice of that microbatch's chunk is still held (its backward waits for the later
slices', each of which attended to the earlier ones' K/V), so some chunk's whole microbatch is.

``memory_lower_bound`` never exceeds the simulated peak: on each rank it walks the generated
schedule's compute order and keeps what the simulator keeps (activations, K/V, dK/dV buffers);
a rank's actions run one after another, so the order alone fixes its peak; messages in flight
would only add.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_slim.plan.schedule.ir import Kind, Schedule
from megatron_slim.plan.sim.costs import RecipeCosts


@dataclass(frozen=True)
class StageTimes:
    """One stage's per-microbatch totals and its cheapest and dearest slices."""

    forward_backward: float  # sum over slices of forward + backward
    min_forward: float
    min_backward: float
    spread: float  # (forward + backward) of the dearest slice minus that of the cheapest


@dataclass(frozen=True)
class TimeBounds:
    lower: float  # never above the simulated iteration time
    estimate: float  # a ranking guess, not a bound


def _stage_class(stage: int, num_stages: int) -> int:
    """Stages cost the same but for the first (embedding) and last (output layer)."""
    return stage if stage in (0, num_stages - 1) else 1


def _stage_times(costs: RecipeCosts, stages: set[int]) -> dict[int, StageTimes]:
    out = {}
    for stage in sorted(stages):
        fwd = [costs.forward(stage, 0, j) for j in range(len(costs.lengths))]
        bwd = [costs.backward(stage, 0, j) for j in range(len(costs.lengths))]
        pair = [f + b for f, b in zip(fwd, bwd)]
        out[stage] = StageTimes(sum(pair), min(fwd), min(bwd), max(pair) - min(pair))
    return out


def time_bounds(costs: RecipeCosts, every_stage: bool = False) -> TimeBounds:
    """Iteration-time lower bound and ranking estimate of ``costs.recipe`` (seconds).

    Cheap form (``every_stage=False``, ``pp >= 3``): rank ``pp - 2`` alone, whose stages are all
    middle ones, the stages before it priced as middle ones too (the embedding only adds), so one
    stage's slices are priced. ``every_stage=True`` prices the first and last stage as well (the
    output layer of a large vocabulary is a real part of the last rank's time) and takes every
    rank: never below the cheap form. The tail uses whole backwards: the generators emit ``B``
    actions, never ``I``/``W``. The estimate adds what unequal slices (uniform slices under a causal
    mask) cost in simulation: each of the ``p - 1`` hops of fill and drain paced by a rank's dearest
    slice on all its chunks instead of the cheapest (fitted on the 70B recipe's uniform-slice runs
    within ~20%)."""
    recipe = costs.recipe
    p, v, m = recipe.parallel.pp, recipe.parallel.vpp, recipe.num_microbatches
    num_stages = p * v
    cheap = p >= 3 and not every_stage
    ranks = [p - 2] if cheap else list(range(p))
    times = _stage_times(costs, {1} if cheap else {_stage_class(s, num_stages) for s in range(num_stages)})

    def of(stage: int) -> StageTimes:
        return times[1 if cheap else _stage_class(stage, num_stages)]

    def span(r: int) -> float:  # rank r's own work, plus the first forwards before it and last backwards after
        busy = m * sum(of(c * p + r).forward_backward for c in range(v))
        return sum(of(s).min_forward + of(s).min_backward for s in range(r)) + busy

    after = [costs.after_pipeline(r) for r in range(p)]
    if recipe.schedule.slice_policy == "exchange" and p > 1:
        return _exchange_bounds([span(r) for r in range(p)], max(span(r) for r in ranks), after)
    lower = max(span(r) for r in ranks) + max(after)
    return TimeBounds(lower, lower + (p - 1) * v * max(t.spread for t in times.values()))


def _exchange_bounds(spans: list[float], slowest: float, after: list[float]) -> TimeBounds:
    """Context exchange moves attention between ranks, so one rank's span is no bound; the work is
    conserved (the taker's gain is the sender's loss), the first slice, whose forwards head the
    pipeline and whose backwards close it, has no prefix to move, and each rank still runs its actions
    one after another: the ranks' mean span bounds the slowest. Its estimate is the uniform lower bound
    without the unequal-slice penalty (the exchange evens out the slots)."""
    return TimeBounds(sum(spans) / len(spans) + min(after), slowest + max(after))


def _unit_bytes(costs: RecipeCosts, num_stages: int) -> dict[tuple[int, int], tuple[float, float]]:
    """(activation, K/V) bytes per (stage class, slice)."""
    out = {}
    for stage in {_stage_class(s, num_stages) for s in range(num_stages)}:
        for j in range(len(costs.lengths)):
            out[stage, j] = (costs.activation_bytes(stage, 0, j), costs.kv_bytes(stage, 0, j))
    return out


def first_backward_memory(costs: RecipeCosts) -> float:
    """A lower bound of the simulated peak memory (bytes) that needs no schedule (see above)."""
    p, v = costs.recipe.parallel.pp, costs.recipe.parallel.vpp
    num_stages = p * v
    unit = _unit_bytes(costs, num_stages)
    held = {
        stage: sum(act + kv for (s, _), (act, kv) in unit.items() if s == stage)
        for stage in {_stage_class(s, num_stages) for s in range(num_stages)}
    }
    return max(
        costs.static_bytes(r) + min(held[_stage_class(c * p + r, num_stages)] for c in range(v)) for r in {0, p - 1}
    )


def memory_lower_bound(costs: RecipeCosts, schedule: Schedule) -> float:
    """A lower bound of the simulated peak memory (bytes, worst rank) of ``schedule`` under ``costs``.

    Walks each rank's compute order with the simulator's accounting (``sim/engine.py``): a forward
    holds its activations and K/V until its backward; the backward of a microbatch's last slice
    allocates the dK/dV buffers of the earlier slices, each slice's backward frees its own."""
    num_stages, n = schedule.num_stages, schedule.num_slices
    unit = _unit_bytes(costs, num_stages)
    grads = {(s, j): costs.kv_grad_bytes(s, 0, j) for (s, j) in unit}
    worst = 0.0
    for r in range(schedule.pp):
        held = peak = 0.0
        for a in schedule.compute_actions(r):
            key = (_stage_class(schedule.stage(r, a.chunk), num_stages), a.slice)
            act, kv = unit[key]
            if a.kind is Kind.F:
                held += act + kv
            elif a.kind is Kind.W:
                held -= act
            else:  # B or I: dK/dV buffers of the earlier slices while the last slice's backward runs
                if a.slice == n - 1 and n > 1:
                    held += sum(grads[key[0], i] for i in range(n - 1))
                peak = max(peak, held)
                held -= kv + (grads[key] if a.slice < n - 1 else 0.0) + (act if a.kind is Kind.B else 0.0)
            peak = max(peak, held)
        worst = max(worst, peak + costs.static_bytes(r))
    return worst
