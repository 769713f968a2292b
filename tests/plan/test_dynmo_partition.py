"""DynMo's repartitioner against brute force: the exact min-max split, never an empty stage, never
over the memory cap, ties to the fewest moved layers; the diffusion variant never beats it."""

import itertools
import random

import pytest

from megatron_slim.plan.dynmo.costs import LayerCost, StageExtras, in_flight_units
from megatron_slim.plan.dynmo.partition import Partition, StageLoads
from megatron_slim.plan.dynmo.solve import (
    diffuse,
    migration_bytes,
    pipeline_step_s,
    repartition,
    worth_migrating,
)
from megatron_slim.plan.schedule.executable import executable


def compositions(total, parts):
    for cuts in itertools.combinations(range(1, total), parts - 1):
        edges = (0, *cuts, total)
        yield Partition(tuple(b - a for a, b in zip(edges, edges[1:])))


def brute_force(loads, cap):
    """Every split of the layers, priced by summing each stage's layers directly."""
    feasible = []
    for p in compositions(len(loads.layers), len(loads.in_flight)):
        if max(loads.stage_memory(p)) <= cap:
            feasible.append((max(loads.stage_times(p)), p))
    return feasible


def random_loads(rng, num_layers, num_stages):
    layers = [
        LayerCost(rng.uniform(0.1, 3), rng.uniform(0, 6), rng.choice([1.0, 2.0, 4.0]), rng.choice([0.5, 1.0, 3.0]))
        for _ in range(num_layers)
    ]
    extras = StageExtras(rng.uniform(0, 2), rng.uniform(0, 4), rng.uniform(0, 3), rng.uniform(0, 3))
    in_flight = [num_stages - s for s in range(num_stages)]
    return StageLoads(layers, extras, in_flight)


@pytest.mark.parametrize("seed", range(60))
def test_equals_the_brute_force_optimum_and_moves_the_fewest_layers(seed):
    rng = random.Random(seed)
    num_stages = rng.randint(1, 4)
    num_layers = rng.randint(num_stages, 9)
    loads = random_loads(rng, num_layers, num_stages)
    everything = brute_force(loads, float("inf"))
    smallest = min(max(loads.stage_memory(p)) for _, p in everything)
    cap = rng.uniform(smallest, smallest * 1.5)
    feasible = brute_force(loads, cap)
    current = rng.choice([p for _, p in everything])
    got = repartition(loads, cap, current)
    best = min(t for t, _ in feasible)
    assert max(loads.stage_times(got)) == pytest.approx(best, rel=1e-12)
    assert min(got.layers_per_stage) >= 1 and got.num_layers == num_layers
    assert max(loads.stage_memory(got)) <= cap
    fewest = min(p.moves_from(current) for t, p in feasible if t <= best * (1 + 1e-9))
    assert got.moves_from(current) == fewest


def test_never_an_empty_stage_where_bisection_leaves_one():
    """DeepSpeed's bisection splits [1, 1, 1, 1, 1] over 4 stages as [2, 2, 1, 0]."""
    loads = StageLoads([LayerCost(1, 0)] * 5, StageExtras(), [1] * 4)
    got = repartition(loads, float("inf"))
    assert sorted(got.layers_per_stage) == [1, 1, 1, 2]
    assert max(loads.stage_times(got)) == 2


def test_the_memory_cap_moves_layers_off_the_stage_that_holds_most_in_flight():
    layers = [LayerCost(1, 2, static_bytes=1, activation_bytes=1)] * 8
    loads = StageLoads(layers, StageExtras(), [4, 3, 2, 1])
    unconstrained = repartition(loads, float("inf"))
    assert unconstrained.layers_per_stage == (2, 2, 2, 2)  # the even split was the reference
    capped = repartition(loads, 9.0)  # stage 0 holds 4 units: 2 layers would need 2 + 4 * 2 = 10
    assert capped.layers_per_stage[0] == 1
    assert max(loads.stage_memory(capped)) <= 9.0
    # k layers on stage s hold k * (1 + in_flight[s]) bytes: (1, 2, 2, 3) layers give 5, 8, 6, 6
    with pytest.raises(ValueError, match=r"memory_cap=4 bytes; the smallest possible largest stage is 8 bytes"):
        repartition(loads, 4.0)


def test_refuses_more_stages_than_layers_and_a_foreign_current_split():
    loads = StageLoads([LayerCost(1, 1)] * 3, StageExtras(), [1] * 4)
    with pytest.raises(ValueError, match="4 stages for 3 layers; allowed: 1 to 3 stages"):
        repartition(loads, 1.0)
    loads = StageLoads([LayerCost(1, 1)] * 6, StageExtras(), [1] * 2)
    with pytest.raises(ValueError, match=r"current split \(2, 2, 2\)"):
        repartition(loads, 1e9, Partition((2, 2, 2)))


def test_freezing_the_front_half_moves_layers_forward():
    """Frozen layers skip their weight gradients: the front stages go idle until layers move."""
    layers = [LayerCost(1, 0) if i < 8 else LayerCost(1, 2) for i in range(16)]
    loads = StageLoads(layers, StageExtras(), [1] * 4)
    even = Partition.even(16, 4)
    balanced = repartition(loads, float("inf"), even)
    assert loads.stage_times(even) == [4, 4, 12, 12]
    # 32 units over 4 stages: 8 each would need a last stage of 3-unit layers summing to 8
    assert max(loads.stage_times(balanced)) == 9
    assert balanced.layers_per_stage[0] > 4 and balanced.layers_per_stage[3] == 3


@pytest.mark.parametrize("seed", range(30))
def test_diffusion_never_beats_the_exact_split(seed):
    rng = random.Random(100 + seed)
    loads = random_loads(rng, 10, 4)
    start = Partition.even(10, 4)
    exact = repartition(loads, float("inf"), start)
    diffused = diffuse(loads, float("inf"), start)
    assert max(loads.stage_times(exact)) <= max(loads.stage_times(diffused)) * (1 + 1e-12)
    assert max(loads.stage_times(diffused)) <= max(loads.stage_times(start))


def test_diffusion_stops_at_a_local_optimum_the_exact_solver_passes():
    """Stage 0 (9) can only hand a layer to stage 1, which is as slow: neighbour moves stall."""
    layers = [LayerCost(t, 0) for t in (5, 4, 4, 5, 3)]
    loads = StageLoads(layers, StageExtras(), [1, 1, 1])
    start = Partition((2, 2, 1))
    assert diffuse(loads, float("inf"), start) == start
    exact = repartition(loads, float("inf"), start)
    assert exact.layers_per_stage == (1, 2, 2) and max(loads.stage_times(exact)) == 8


@pytest.mark.parametrize(
    "shape,expected",
    [
        (("1f1b", 4, 1, 8, 1), (4, 3, 2, 1)),  # stage s warms up with p - s forwards
        (("1f1b", 4, 1, 2, 1), (2, 2, 2, 1)),  # capped by the microbatch count
        (("slimpipe", 4, 1, 4, 4), (7, 6, 5, 4)),
    ],
)
def test_in_flight_units_read_off_the_schedule(shape, expected):
    assert in_flight_units(executable(*shape)) == expected


def test_trigger_weighs_the_saving_against_the_move():
    layers = [LayerCost(1, 1, static_bytes=10) for _ in range(6)]
    loads = StageLoads(layers, StageExtras(), [1, 1])
    now, after = Partition((1, 5)), Partition((3, 3))
    assert migration_bytes(loads, now, after) == 20
    step_now = pipeline_step_s(loads.stage_times(now), 4)
    step_after = pipeline_step_s(loads.stage_times(after), 4)
    assert (step_now, step_after) == (12 + 3 * 10, 12 + 3 * 6)
    assert worth_migrating(step_now, step_after, steps_until_next_change=10, migration_s=119)
    assert not worth_migrating(step_now, step_after, steps_until_next_change=10, migration_s=120)
