"""The rebalancing decision ``megatron-slim train`` takes every ``dynmo.rebalance_interval`` iterations.

Pure: the same whole-model profile, split and measured migration cost give the same ``Decision`` on
every rank. The measured profile covers decoder layers only; the first stage's embedding and the
last stage's output layer and loss are priced by the cost model as multiples of one decoder
layer's forward + backward (``StageModel``), and scaled by the slowest measured layer (a layer that
still trains, as the embedding and output layer do). Predicted step times are the 1F1B critical
path (``solve.pipeline_step_s``) over the recipe's microbatches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Optional

from megatron_slim.plan.cost.model import CostModel
from megatron_slim.plan.dynmo.costs import LayerCost, StageExtras, in_flight_units
from megatron_slim.plan.dynmo.partition import Partition, StageLoads
from megatron_slim.plan.dynmo.profile import LayerProfile, merged
from megatron_slim.plan.dynmo.solve import diffuse, migration_bytes, pipeline_step_s, repartition, worth_migrating
from megatron_slim.plan.recipe import Recipe
from megatron_slim.plan.schedule.executable import executable
from megatron_slim.plan.sim.costs import RecipeCosts


@dataclass(frozen=True)
class StageModel:
    """What the recipe adds to a measured profile: fixed stage terms, in-flight units, the cap."""

    first_layers: float  # the first stage's fixed time, in decoder layers (forward + backward)
    last_layers: float  # the last stage's, likewise
    first_bytes: float
    last_bytes: float
    in_flight: tuple[int, ...]  # forward units each stage holds at its peak
    units_per_microbatch: int  # slices per microbatch
    num_microbatches: int
    memory_cap: float  # bytes per stage
    link_bandwidth: float  # bytes/s between neighbouring stages, until a migration is measured


def stage_model(recipe: Recipe) -> StageModel:
    """The recipe's ``StageModel`` (cap: ``dynmo.memory_cap_bytes``, else the hardware profile's)."""
    base = RecipeCosts(recipe, CostModel(recipe))
    cost, slices = base.cost, range(len(base.lengths))
    layer = sum(
        cost.decoder_layer_time(base.lengths[s], base.prefixes[s], False)
        + cost.decoder_layer_time(base.lengths[s], base.prefixes[s], True)
        for s in slices
    )

    def fixed_layers(stage: int) -> float:
        whole = sum(base.forward(stage, 0, s) + base.backward(stage, 0, s) for s in slices)
        return max(0.0, whole / layer - cost.layers_per_stage)

    nominal = cost.layers_per_stage * cost.static_bytes(0) / cost.rank_params(0) * cost.shape.layer_params()
    last = recipe.parallel.pp - 1
    schedule = executable(recipe.schedule.kind, recipe.parallel.pp, 1, recipe.num_microbatches, len(base.lengths))
    cap = recipe.dynmo.memory_cap_bytes or base.hbm_bytes()
    return StageModel(
        fixed_layers(0),
        fixed_layers(last),
        max(0.0, base.static_bytes(0) - nominal),
        max(0.0, base.static_bytes(last) - nominal),
        in_flight_units(schedule),
        len(base.lengths),
        recipe.num_microbatches,
        float(cap),
        base.link(0, 1).bandwidth,
    )


def stage_loads(profiles: Sequence[LayerProfile], model: StageModel) -> StageLoads:
    """The solver's input from a whole-model profile: times per microbatch, activations per unit."""
    layers = [
        LayerCost(p.forward_s, p.backward_s, float(p.static_bytes), p.activation_bytes / model.units_per_microbatch)
        for p in merged([profiles])
    ]
    reference = max(c.time_s for c in layers)
    extras = StageExtras(
        model.first_layers * reference, model.last_layers * reference, model.first_bytes, model.last_bytes
    )
    return StageLoads(layers, extras, model.in_flight)


@dataclass(frozen=True)
class Decision:
    iteration: int
    policy: str
    before: tuple[int, ...]
    proposed: tuple[int, ...]  # the solver's split
    step_before_s: float  # predicted, at the current split
    step_after_s: float  # predicted, at the proposed split
    moved_layers: int
    moved_bytes: float  # the moved layers' weights, gradients and optimizer state
    migration_s: float  # estimated cost of the move
    move: bool

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "before": list(self.before), "proposed": list(self.proposed)}

    def line(self) -> str:
        verdict = "move" if self.move else "stay"
        return (
            f"iter {self.iteration:4d}: dynmo {self.policy}: layers per stage {list(self.before)} -> "
            f"{list(self.proposed)} ({verdict}) | "
            f"predicted step {self.step_before_s * 1e3:.1f} -> {self.step_after_s * 1e3:.1f} ms | "
            f"{self.moved_layers} layers moved, est. {self.migration_s * 1e3:.1f} ms"
        )


def migration_estimate_s(nbytes: float, bandwidth: float, measured: Optional[tuple[float, float]] = None) -> float:
    """A move's cost: the last measured move ``(bytes, seconds)`` scaled by bytes, else ``nbytes``
    over the link (the first move then measures what the link estimate leaves out: rebuilding)."""
    if measured is not None and measured[0] > 0:
        return measured[1] * nbytes / measured[0]
    return nbytes / bandwidth


def decide(
    iteration: int,
    policy: str,
    profiles: Sequence[LayerProfile],
    current: Partition,
    model: StageModel,
    steps_until_next: int,
    measured: Optional[tuple[float, float]] = None,
) -> Decision:
    """Solve the split for the measured profile and say whether moving to it pays before the next
    decision (``steps_until_next`` iterations away); ``measured``: the last move's (bytes, seconds)."""
    loads = stage_loads(profiles, model)
    if policy == "dynmo":
        proposed = repartition(loads, model.memory_cap, current)
    elif policy == "diffusion":
        proposed = diffuse(loads, model.memory_cap, current)
    else:
        proposed = current
    now = pipeline_step_s(loads.stage_times(current), model.num_microbatches)
    after = pipeline_step_s(loads.stage_times(proposed), model.num_microbatches)
    nbytes = migration_bytes(loads, current, proposed)
    cost = migration_estimate_s(nbytes, model.link_bandwidth, measured)
    move = proposed != current and worth_migrating(now, after, steps_until_next, cost)
    return Decision(
        iteration,
        policy,
        current.layers_per_stage,
        proposed.layers_per_stage,
        now,
        after,
        proposed.moves_from(current),
        nbytes,
        cost,
        move,
    )
