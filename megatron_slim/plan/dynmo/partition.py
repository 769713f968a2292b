"""Exact min-max contiguous partition of layers over pipeline stages, under a memory cap.

``repartition`` returns the split whose slowest stage is as fast as any contiguous split can make
it (no tolerance: a dynamic program over the exact sums), with no empty stage and no stage over
its memory cap; among the splits that reach that optimum it picks the one that moves the fewest
layers from the current split, so a live migration carries as little state as possible.
DeepSpeed's bisection partitioner, which DynMo uses, is optimal only to its tolerance and can
return an empty last stage (`[1, 1, 1, 1, 1]` over 4 stages); a DP over at most a few hundred
layers and stages costs milliseconds, so there is no reason to approximate.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_slim.plan.dynmo.costs import LayerCost, StageExtras


@dataclass(frozen=True)
class Partition:
    """``layers_per_stage[s]`` consecutive layers on stage ``s``, in layer order."""

    layers_per_stage: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.layers_per_stage or min(self.layers_per_stage) < 1:
            raise ValueError(
                f"Partition: got layers per stage {self.layers_per_stage}; allowed: every stage >= 1 layer"
            )

    @classmethod
    def even(cls, num_layers: int, num_stages: int) -> Partition:
        """Megatron's static split: as equal as the counts allow, the remainder on the first stages."""
        base, extra = divmod(num_layers, num_stages)
        return cls(tuple(base + (s < extra) for s in range(num_stages)))

    @property
    def num_layers(self) -> int:
        return sum(self.layers_per_stage)

    @property
    def num_stages(self) -> int:
        return len(self.layers_per_stage)

    def bounds(self) -> list[tuple[int, int]]:
        """``[start, end)`` layer range of every stage."""
        ends = list(itertools.accumulate(self.layers_per_stage))
        return list(zip([0, *ends[:-1]], ends))

    def stage_of_layer(self) -> list[int]:
        return [s for s, n in enumerate(self.layers_per_stage) for _ in range(n)]

    def moves_from(self, other: Partition) -> int:
        """Layers that sit on another stage in ``other`` than here: what a migration carries."""
        if other.num_layers != self.num_layers:
            raise ValueError(f"moves_from: {other.num_layers} layers against {self.num_layers}")
        return sum(a != b for a, b in zip(self.stage_of_layer(), other.stage_of_layer()))


@dataclass(frozen=True)
class StageLoads:
    """What the solver prices a split with: per-stage time and memory of any layer range."""

    layers: Sequence[LayerCost]
    extras: StageExtras
    in_flight: Sequence[int]  # forward units each stage holds at its peak (``costs.in_flight_units``)

    def time_s(self, stage: int, start: int, end: int) -> float:
        t = sum(c.time_s for c in self.layers[start:end])
        if stage == 0:
            t += self.extras.first_s
        if stage == len(self.in_flight) - 1:
            t += self.extras.last_s
        return t

    def memory_bytes(self, stage: int, start: int, end: int) -> float:
        held = self.layers[start:end]
        b = sum(c.static_bytes for c in held) + self.in_flight[stage] * sum(c.activation_bytes for c in held)
        if stage == 0:
            b += self.extras.first_bytes
        if stage == len(self.in_flight) - 1:
            b += self.extras.last_bytes
        return b

    def stage_times(self, partition: Partition) -> list[float]:
        return [self.time_s(s, a, b) for s, (a, b) in enumerate(partition.bounds())]

    def stage_memory(self, partition: Partition) -> list[float]:
        return [self.memory_bytes(s, a, b) for s, (a, b) in enumerate(partition.bounds())]
