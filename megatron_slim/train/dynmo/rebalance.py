"""The automatic rebalancing trigger (``dynmo.rebalance``): every ``dynmo.rebalance_interval``
iterations, the training loop asks ``rebalance_if_due`` whether to move layers.

Every rank decides with ``plan.dynmo.trigger.decide`` on the same inputs: world rank 0's smoothed
whole-model profile and last measured migration, broadcast, so data-parallel replicas (whose
profiles differ by noise) cannot disagree; ``migrate`` then votes on the partition as always.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch.distributed as dist

from megatron_slim.plan.dynmo.partition import Partition
from megatron_slim.plan.dynmo.trigger import StageModel, decide, stage_model
from megatron_slim.plan.recipe import Recipe


class Rebalancer:
    """A run's trigger state; it outlives migrations (the loop's per-rank objects are rebuilt)."""

    def __init__(self, recipe: Recipe) -> None:
        d = recipe.dynmo
        self.policy, self.interval, self.iters = d.rebalance, d.rebalance_interval, recipe.train.iters
        self.model: StageModel = stage_model(recipe)
        self.measured: Optional[tuple[float, float]] = None  # the last move's (bytes, seconds)

    @classmethod
    def for_recipe(cls, recipe: Recipe) -> Optional[Rebalancer]:
        return cls(recipe) if recipe.dynmo.rebalancing else None


def rebalance_if_due(training: Any, number: int) -> bool:
    """Decide at iteration ``number`` if one is due, move layers if it pays, and record the decision
    in ``report.dynmo["rebalance"]``; always True (the trigger never releases ranks)."""
    from megatron_slim.train.dynmo.migration import current_partition, migrate  # looked up now: tests wrap it

    r: Optional[Rebalancer] = training.rebalancer
    if r is None or number % r.interval or number >= r.iters:
        return True
    profiler = training.dynamic.profiler
    profiles, measured = _from_rank0((profiler.whole_model if profiler else [], r.measured))
    if not profiles:  # a planned move rebuilt the profiler this iteration: nothing measured yet
        return True
    current = current_partition(training.chunks, training.groups)
    decision = decide(number, r.policy, profiles, current, r.model, min(r.interval, r.iters - number), measured)
    entry = decision.to_dict()
    if decision.move:
        began = time.perf_counter()
        migrate(training, Partition(decision.proposed))
        r.measured = (decision.moved_bytes, time.perf_counter() - began)
        entry["measured_migration_s"] = _from_rank0(r.measured[1])
    training.report.dynmo.setdefault("rebalance", []).append(entry)
    if training.reporter and not training.options.quiet:
        print(decision.line(), flush=True)
    return True


def _from_rank0(value: Any) -> Any:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
