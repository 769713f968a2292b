"""A measured per-layer profile, as the repartitioner reads it (``costs.LayerCost``).

``megatron-slim train`` with ``dynmo.profile`` measures one ``LayerProfile`` per decoder layer on the
rank that holds it (``train.dynmo.profile``), smooths it over iterations (``smoothed``) and gathers
the whole model's list to every pipeline rank; ``layer_costs`` turns that list into the solver's
input. Times and activation bytes are per microbatch (summed over a microbatch's slices).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from megatron_slim.plan.dynmo.costs import LayerCost


@dataclass(frozen=True)
class LayerProfile:
    layer: int  # global 0-based index
    forward_s: float
    backward_s: float
    parameter_bytes: int
    gradient_bytes: int  # of the parameters that train (a frozen layer has none)
    optimizer_bytes: int  # optimizer state held for the layer's parameters
    activation_bytes: float  # saved for backward by one microbatch's forward

    @property
    def static_bytes(self) -> int:
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_bytes

    def to_layer_cost(self) -> LayerCost:
        return LayerCost(self.forward_s, self.backward_s, float(self.static_bytes), self.activation_bytes)

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def smoothed(previous: LayerProfile | None, newest: LayerProfile, weight: float) -> LayerProfile:
    """Exponential smoothing of the times and activation bytes (``weight`` on the newest
    iteration); the static bytes are the newest, as they are exact, not noisy."""
    if previous is None or weight == 1:
        return newest
    if previous.layer != newest.layer:
        raise ValueError(f"smoothed: layer {previous.layer} against layer {newest.layer}")

    def mix(a: float, b: float) -> float:
        return (1 - weight) * a + weight * b

    return LayerProfile(
        newest.layer,
        mix(previous.forward_s, newest.forward_s),
        mix(previous.backward_s, newest.backward_s),
        newest.parameter_bytes,
        newest.gradient_bytes,
        newest.optimizer_bytes,
        mix(previous.activation_bytes, newest.activation_bytes),
    )


def merged(per_rank: Sequence[Sequence[LayerProfile]]) -> list[LayerProfile]:
    """The pipeline ranks' lists as one, in layer order; every layer exactly once."""
    layers = sorted((p for rank in per_rank for p in rank), key=lambda p: p.layer)
    indices = [p.layer for p in layers]
    if indices != list(range(len(indices))):
        raise ValueError(f"merged: layers {indices}; expected each of 0..{len(indices) - 1} exactly once")
    return layers


def layer_costs(profiles: Sequence[LayerProfile]) -> list[LayerCost]:
    """The repartitioner's per-layer costs from a whole-model profile (``merged``)."""
    return [p.to_layer_cost() for p in merged([profiles])]
