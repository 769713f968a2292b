"""Early exit (``--dynmo-exit-threshold``) and mixture of depths (``--dynmo-mod-capacity``) in the
model Megatron-LM builds.

Megatron-LM's model builder takes a layer *spec* and builds every decoder layer from the class it
names, so both dynamic models enter as a class swapped into the spec the GPT layer-spec builders
return (``megatron.hooks``): ``EarlyExitTransformerLayer`` with the rule baked into the class
(``model.early_exit.early_exit_layer``) or ``MixtureOfDepthsLayer`` (whose router is a parameter
created with the layer, so DDP's buffers and the optimizer include it like any other weight).
Both subclass megatron-core's ``TransformerLayer`` and keep its parameters and their names, so
checkpoints of the stock model load into them.
"""

from __future__ import annotations

from typing import Any, Optional

from megatron_slim.megatron.model.layer_specs import LayerSwap, with_layer_module


def dynamic_layer_swap(args: Any) -> Optional[LayerSwap]:
    """The layer class the parsed ``--dynmo-*`` flags build every decoder layer as, or None."""
    if args is None:
        return None
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron_slim.megatron.launch.dynmo_flags import dynmo_from_megatron_args

    d = dynmo_from_megatron_args(args)
    if d.early_exit:
        from megatron_slim.megatron.model.early_exit import early_exit_layer

        exit_layer = early_exit_layer(d.exit_threshold, d.exit_from_layer)
        return LayerSwap(exit_layer, (TransformerLayer,), "--dynmo-exit-threshold")
    if d.mixture_of_depths:
        from megatron_slim.megatron.model.mixture_of_depths import mixture_of_depths_layer

        return LayerSwap(mixture_of_depths_layer(d.mod_capacity), (TransformerLayer,), "--dynmo-mod-capacity")
    return None


def with_dynamic_layer(spec: Any, args: Any) -> Any:
    """``spec`` with the dynamic layer class swapped in, when the flags ask for one."""
    swap = dynamic_layer_swap(args)
    return spec if swap is None else with_layer_module(spec, swap)
