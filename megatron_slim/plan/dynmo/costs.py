"""What a layer costs a pipeline stage: time per microbatch and memory, as the repartitioner reads it.

Stage ``s``'s time is the sum of its layers' forward and backward times plus the stage's fixed
terms (the embedding on the first stage, the output layer and loss on the last). Its memory is
its layers' static bytes (weights, gradients, optimizer state) plus, per forward unit the schedule
keeps in flight on that stage (``in_flight_units``), the layers' activation bytes for one unit,
plus the stage's fixed bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_slim.plan.schedule.ir import Kind, Schedule


@dataclass(frozen=True)
class LayerCost:
    forward_s: float
    backward_s: float
    static_bytes: float = 0.0  # parameters, gradients and optimizer state held for this layer
    activation_bytes: float = 0.0  # saved for backward, per forward unit in flight

    def __post_init__(self) -> None:
        for name in ("forward_s", "backward_s", "static_bytes", "activation_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"LayerCost.{name}: got {getattr(self, name)}; allowed: >= 0")

    @property
    def time_s(self) -> float:
        return self.forward_s + self.backward_s


@dataclass(frozen=True)
class StageExtras:
    """Fixed work of the stages that hold more than decoder layers."""

    first_s: float = 0.0  # embedding, forward + backward
    last_s: float = 0.0  # final norm, output layer and loss
    first_bytes: float = 0.0
    last_bytes: float = 0.0


def in_flight_units(schedule: Schedule) -> tuple[int, ...]:
    """Per pipeline stage, the most forward units (microbatches, or slices under SlimPipe) whose
    activations it holds at once, read off the schedule's actions: a forward holds its unit's
    activations until the backward that frees them (``B``, or ``W`` when the backward is split).
    Works for every generator (1F1B, interleaved, SlimPipe), so the partitioner prices the memory of
    the schedule in use rather than a closed form of one of them."""
    peaks = [0] * schedule.num_stages
    for rank, actions in enumerate(schedule.ranks):
        held = [0] * schedule.vpp
        for a in actions:
            if a.kind is Kind.F:
                held[a.chunk] += 1
                stage = schedule.stage(rank, a.chunk)
                peaks[stage] = max(peaks[stage], held[a.chunk])
            elif a.kind in (Kind.B, Kind.W):
                held[a.chunk] -= 1
    return tuple(peaks)
