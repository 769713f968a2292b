"""The one rewriter of megatron-core layer specs: plug a core attention (and optionally a layer
class) into every layer of a spec, as SlimPipe (``SliceCoreAttention``), the CP engines
(``CPCoreAttention``, ``RemapTransformerLayer``) and ``model.gpt.layer_spec`` need."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class LayerSwap:
    """Build every layer as ``module`` instead of one of ``replaces``; ``flag`` asked for it."""

    module: type
    replaces: tuple[type, ...]
    flag: str


def with_core_attention(spec: Any, core_attention: type, *, flag: str, swap: Optional[LayerSwap] = None) -> Any:
    """A copy of a layer spec / submodules / block spec (``layer_specs``) with ``core_attention`` in
    each layer's ``self_attention.core_attention`` slot and, with ``swap``, each layer's module
    (where the spec names one) swapped. ``flag`` names the input that asked, for errors."""
    spec = copy.deepcopy(spec)
    for layer in getattr(spec, "layer_specs", None) or [spec]:
        sub = getattr(layer, "submodules", layer)
        attention_sub = getattr(getattr(sub, "self_attention", None), "submodules", None)
        if attention_sub is None or not hasattr(attention_sub, "core_attention"):
            raise ValueError(
                f"{flag}: this layer spec has no self_attention.core_attention slot to put "
                f"{core_attention.__name__} in ({type(layer).__name__})"
            )
        attention_sub.core_attention = core_attention
        if swap is not None:
            _swap_module(layer, swap)
    return spec


def with_layer_module(spec: Any, swap: LayerSwap) -> Any:
    """A copy of a layer spec / block spec with each layer built as ``swap.module``; a bare
    submodules object (no module named) comes back as it was."""
    spec = copy.deepcopy(spec)
    for layer in getattr(spec, "layer_specs", None) or [spec]:
        _swap_module(layer, swap)
    return spec


def _swap_module(layer: Any, swap: LayerSwap) -> None:
    if not (hasattr(layer, "module") and hasattr(layer, "submodules")):
        return
    if layer.module not in swap.replaces + (swap.module,):
        built = getattr(layer.module, "__name__", layer.module)
        allowed = " or ".join(f"megatron-core's {m.__name__}" for m in swap.replaces)
        raise ValueError(
            f"{swap.flag}: the layer spec builds {built}; allowed: {allowed} (the {swap.module.__name__} subclasses it)"
        )
    layer.module = swap.module
