"""Which decoder layers of a model chunk offload their activations (``train.offload_ratio``).

Offloading is per layer: of the ``L`` transformer layers of a chunk that keep their activations
(all of them, but none under full uniform recomputation and only those after the first
``recompute_num_layers`` under block recomputation, whose checkpointed layers save nothing), the first
``floor(ratio * L + 1/2)`` move their saved activations to host memory during each forward action
(the first layers' are the last a slice's backward needs, which leaves the most time to bring them
back). Hooks switch the ``ActivationOffload`` on around those layers' forward and are removed after
the call.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch

from megatron_slim.runtime.pipeline.offload import ActivationOffload


def offloaded_layer_count(ratio: float, layers: int) -> int:
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"offload ratio {ratio}: allowed values lie in [0, 1]")
    return math.floor(ratio * layers + 0.5)


def attach_offload(
    models: Sequence[torch.nn.Module], ratio: float, kept_storages: Callable[[], set]
) -> tuple[Optional[ActivationOffload], list]:
    """An ``ActivationOffload`` switched on around the offloaded layers of every chunk in ``models``,
    and the hook handles to remove when the call ends (None and no hooks for ratio 0)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    if ratio == 0:
        return None, []
    offload = ActivationOffload([p for m in models for p in m.parameters()], kept_storages)
    handles = []
    for model in models:
        layers = _saving_layers([m for m in model.modules() if isinstance(m, TransformerLayer)])
        for layer in layers[: offloaded_layer_count(ratio, len(layers))]:
            handles.append(layer.register_forward_pre_hook(lambda module, args: _switch(offload, True)))
            handles.append(layer.register_forward_hook(lambda module, args, out: _switch(offload, False)))
    return offload, handles


def _saving_layers(layers: list) -> list:
    """The layers whose activations autograd keeps (not checkpointed by full recomputation)."""
    if not layers or getattr(layers[0].config, "recompute_granularity", None) != "full":
        return layers
    config = layers[0].config
    return layers[config.recompute_num_layers :] if config.recompute_method == "block" else []


def _switch(offload: ActivationOffload, on: bool) -> None:
    offload.active = on
