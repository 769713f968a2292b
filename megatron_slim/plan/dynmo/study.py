"""Training of a dynamic model, phase by phase, under a static split or a rebalancing policy.

Training is cut into ``num_phases`` equal phases; in each, the scheme's per-layer loads at the
phase's middle hold for all its steps. ``static`` keeps Megatron's even split throughout;
``dynmo`` re-solves the exact split (``repartition``) at every phase change and ``diffusion``
runs DynMo's diffusion balancer, each adopting the new split only when the time it saves over the
phase exceeds the migration (``worth_migrating``: the moved layers' weights, gradients and
optimizer state over the pipeline link). Every iteration time is the pipeline simulator's, on the
recipe's own schedule.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_slim.plan.cost.calibration import Calibration
from megatron_slim.plan.cost.model import CostModel
from megatron_slim.plan.dynmo.costs import LayerCost, StageExtras, in_flight_units
from megatron_slim.plan.dynmo.partition import Partition, StageLoads
from megatron_slim.plan.dynmo.pipeline_costs import PartitionedCosts, check_dynamic_recipe
from megatron_slim.plan.dynmo.schemes import LayerLoad, layer_loads
from megatron_slim.plan.dynmo.solve import diffuse, migration_bytes, repartition, worth_migrating
from megatron_slim.plan.recipe import Recipe
from megatron_slim.plan.schedule.executable import executable
from megatron_slim.plan.schema import ConfigError
from megatron_slim.plan.sim.costs import RecipeCosts
from megatron_slim.plan.sim.engine import simulate

REBALANCE = ("static", "dynmo", "diffusion")


@dataclass(frozen=True)
class Phase:
    progress: float  # the phase's middle, as a fraction of training
    layers_per_stage: tuple[int, ...]
    iteration_time_s: float
    peak_memory_bytes: float
    moved_layers: int  # at the start of this phase
    migration_s: float


@dataclass(frozen=True)
class Study:
    scheme: str
    rebalance: str
    steps_per_phase: float
    phases: tuple[Phase, ...]

    @property
    def total_s(self) -> float:
        return sum(p.iteration_time_s * self.steps_per_phase + p.migration_s for p in self.phases)


def run_study(
    recipe: Recipe,
    scheme: str,
    rebalance: str,
    num_phases: int = 8,
    seed: int = 0,
    calibration: Calibration | None = None,
) -> Study:
    if rebalance not in REBALANCE:
        raise ConfigError(f"--rebalance: got {rebalance!r}; allowed: {', '.join(REBALANCE)}")
    if num_phases < 1:
        raise ConfigError(f"phases: got {num_phases}; allowed: >= 1")
    check_dynamic_recipe(recipe)
    p = recipe.parallel
    base = RecipeCosts(recipe, CostModel(recipe, calibration=calibration))
    schedule = executable(recipe.schedule.kind, p.pp, 1, recipe.num_microbatches, recipe.schedule.num_slices)
    steps = recipe.train.iters / num_phases
    current = Partition.even(recipe.model.num_layers, p.pp)
    phases = []
    for k in range(num_phases):
        x = (k + 0.5) / num_phases
        loads = layer_loads(scheme, x, recipe.model.num_layers, _gemm_share(base), seed)
        stage_loads = _stage_loads(base, loads, in_flight_units(schedule))
        now = simulate(schedule, PartitionedCosts(base, current, loads))
        target = _proposal(rebalance, stage_loads, base.hbm_bytes(), current)
        moved, migration = 0, 0.0
        if target != current:
            after = simulate(schedule, PartitionedCosts(base, target, loads))
            cost_s = migration_bytes(stage_loads, current, target) / base.link(0, 1).bandwidth
            if worth_migrating(now.iteration_time_s, after.iteration_time_s, int(steps), cost_s):
                moved, migration, current, now = target.moves_from(current), cost_s, target, after
        peak = max(r.peak_memory_bytes for r in now.ranks)
        phases.append(Phase(x, current.layers_per_stage, now.iteration_time_s, peak, moved, migration))
    return Study(scheme, rebalance, steps, tuple(phases))


def _proposal(rebalance: str, loads: StageLoads, cap: float, current: Partition) -> Partition:
    if rebalance == "dynmo":
        return repartition(loads, cap, current)
    if rebalance == "diffusion":
        return diffuse(loads, cap, current)
    return current


def _gemm_share(base: RecipeCosts) -> float:
    """Share of a middle slice's decoder-layer forward spent in GEMMs and memory-bound kernels."""
    cost, middle = base.cost, len(base.lengths) // 2
    tokens, prefix = base.lengths[middle], base.prefixes[middle]
    work = cost.shape.forward_work(tokens, prefix)
    rest = cost.kernel_time(type(work)(work.gemm_flops, 0.0, work.memory_bytes), False)
    return min(1.0, rest / cost.decoder_layer_time(tokens, prefix, False))


def _stage_loads(base: RecipeCosts, loads: list[LayerLoad], in_flight: tuple[int, ...]) -> StageLoads:
    """What the repartitioner prices: per layer, a microbatch's forward and backward over all its
    slices, its static bytes and its activations plus K/V per slice in flight (mean slice)."""
    cost, slices = base.cost, range(len(base.lengths))
    fwd = sum(cost.decoder_layer_time(base.lengths[s], base.prefixes[s], False) for s in slices)
    bwd = sum(cost.decoder_layer_time(base.lengths[s], base.prefixes[s], True) for s in slices)
    mean = sum(base.lengths) / len(base.lengths)
    per_unit = cost.chunk.resident_bytes(mean) / cost.layers_per_stage + cost.shape.kv_bytes(mean)
    static = cost.static_bytes(0) / cost.rank_params(0) * cost.shape.layer_params()
    layers = [LayerCost(fwd * w.forward, bwd * w.backward, static, per_unit * w.activations) for w in loads]
    last = cost.num_stages - 1

    def fixed_s(stage: int) -> float:
        whole = sum(base.forward(stage, 0, s) + base.backward(stage, 0, s) for s in slices)
        return whole - cost.layers_per_stage * (fwd + bwd)

    nominal_static = cost.layers_per_stage * static
    extras = StageExtras(
        fixed_s(0), fixed_s(last), base.static_bytes(0) - nominal_static, base.static_bytes(last) - nominal_static
    )
    return StageLoads(layers, extras, in_flight)


def speedup(static: Study, other: Study) -> float:
    return static.total_s / other.total_s
