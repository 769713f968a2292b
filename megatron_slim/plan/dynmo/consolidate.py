"""Consolidation: the fewest pipeline stages that still fit the memory cap, and which ranks leave.

DynMo releases workers once a dynamic model has shed enough work (frozen or pruned layers) that
fewer stages hold it. ``fewest_stages`` re-solves the exact min-max split (``solve.repartition``)
for 1, 2, ... stages and returns the first that fits ``memory_cap``: the in-flight counts come
from a callback because they depend on the schedule at that stage count (``costs.in_flight_units``
of the schedule the run would use). The runtime keeps pipeline ranks ``0 .. K-1`` (stage ``s`` of
the new split on rank ``s``, so layer order and the embedding's rank stay) and releases the rest
(``released_ranks``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Optional

from megatron_slim.plan.dynmo.costs import LayerCost, StageExtras
from megatron_slim.plan.dynmo.partition import Partition, StageLoads
from megatron_slim.plan.dynmo.solve import repartition


def fewest_stages(
    layers: Sequence[LayerCost],
    extras: StageExtras,
    in_flight: Callable[[int], Sequence[int]],
    memory_cap: float,
    max_stages: int,
    min_stages: int = 1,
) -> Partition:
    """The exact min-max split over the fewest stages in ``[min_stages, max_stages]`` whose every
    stage fits ``memory_cap``; ``in_flight(k)`` gives the k stages' in-flight forward units.
    Raises ``ValueError`` naming the cap when no stage count in the range fits."""
    if not 1 <= min_stages <= max_stages <= len(layers):
        raise ValueError(
            f"fewest_stages: stages {min_stages}..{max_stages} for {len(layers)} layers; "
            f"allowed: 1 <= min_stages <= max_stages <= {len(layers)}"
        )
    smallest: Optional[str] = None
    for k in range(min_stages, max_stages + 1):
        counts = tuple(in_flight(k))
        if len(counts) != k:
            raise ValueError(f"fewest_stages: in_flight({k}) gave {len(counts)} counts; allowed: {k}")
        try:
            return repartition(StageLoads(layers, extras, counts), memory_cap)
        except ValueError as exc:
            smallest = smallest or str(exc)
    raise ValueError(
        f"fewest_stages: no split over {min_stages}..{max_stages} stages fits memory_cap={memory_cap:.4g} bytes "
        f"(first refusal: {smallest})"
    )


def released_ranks(stages_now: int, stages_after: int) -> tuple[int, ...]:
    """Pipeline ranks that leave when ``stages_now`` stages become ``stages_after``."""
    if not 1 <= stages_after < stages_now:
        raise ValueError(f"released_ranks: {stages_now} -> {stages_after} stages; allowed: 1 <= after < now")
    return tuple(range(stages_after, stages_now))
