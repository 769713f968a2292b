"""Layer freezing (``--dynmo-freeze``) inside Megatron-LM's loop.

From the iteration the schedule names, a frozen layer's parameters get ``requires_grad = False``,
so autograd no longer reaches their gradient accumulators: the backward computes only the layers'
input gradients and skips their weight gradients. What that does to megatron-core's DDP (checked
on 0.16.1, ``distributed/distributed_data_parallel.py`` and ``param_and_grad_buffer.py``):

* the gradient buffers, buckets and the distributed optimizer's shards were laid out at wrap time
  for every parameter that required a gradient then; they stay as they are (nothing is rebuilt, so
  no state is lost). DDP's backward hook, which adds ``param.grad`` into ``param.main_grad``, sits
  on the accumulator and so never fires for a frozen parameter: its ``main_grad`` stays at the
  zeros ``zero_grad_buffer`` writes each iteration and ``param.grad`` stays None;
* without ``--overlap-grad-reduce`` every bucket is reduced in ``finish_grad_sync`` whether its
  parameters reported or not: the frozen ranges reduce zeros, exact and cheap;
* with ``--overlap-grad-reduce`` a bucket is launched only when every one of its parameters has
  reported a gradient (``register_grad_ready`` against the counts of the first batch) and
  ``finish_grad_sync`` asserts it was launched; ``--overlap-param-gather`` (which needs it) also
  asserts ``requires_grad`` on every buffered parameter. A frozen parameter would break both, so
  there (and under Megatron FSDP, whose hooks differ) the frozen layers keep ``requires_grad`` and
  compute weight gradients that are dropped below (``skips_weight_grads``).

Either way the optimizer must not see them: a zero gradient still moves a weight by Adam's moments
and by weight decay. After Megatron's ``prepare_grads`` has copied the reduced gradients onto the
main parameters, each frozen layer's main parameters get ``.grad = None`` (``decoupled_grad``
too). Megatron's gradient norm and clipping leave them out (they skip parameters without a
gradient, as ``megatron-slim train`` does for frozen layers) and the inner Adam/AdamW skips them
entirely, so their main parameters, moments and step count stay as they were and the copy from
main to model parameters writes back the same values: the frozen weights are bit-identical from
the freeze point on, on every data-parallel rank.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

from megatron_slim.megatron.dynmo.main_params import MainParams, sub_optimizers


def decoder_layers_of(model) -> list:
    """Megatron's ``TransformerLayer`` modules of the built (possibly DDP-wrapped) model chunks, in
    order; ``layer.layer_number - 1`` is a layer's global index."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    return [m for chunk in model for m in chunk.modules() if isinstance(m, TransformerLayer)]


def weight_grads_kept_by(args: Any) -> Optional[str]:
    """The flag under which frozen layers must keep computing weight gradients (see the module's
    docstring), or None when they can skip them."""
    for name in ("overlap_grad_reduce", "use_megatron_fsdp", "use_torch_fsdp2"):
        if getattr(args, name, False):
            return "--" + name.replace("_", "-")
    return None


class FrozenLayers:
    """Freezes layers on ``model`` (``requires_grad``, when ``skips_weight_grads``) and drops their
    gradients at every step of ``optimizer``."""

    def __init__(self, model, optimizer, main_params: MainParams, *, skips_weight_grads: bool) -> None:
        self.layers = decoder_layers_of(model)
        self.main_params = main_params
        self.skips_weight_grads = skips_weight_grads
        self.frozen: frozenset[int] = frozenset()
        self._mains: list = []
        for sub in sub_optimizers(optimizer):
            sub.prepare_grads = self._dropping_frozen(sub.prepare_grads)

    def set(self, frozen: frozenset[int]) -> None:
        """Freeze the layers whose global index is in ``frozen`` (the others train)."""
        if frozen == self.frozen:
            return
        self.frozen = frozen
        layers = [layer for layer in self.layers if layer.layer_number - 1 in frozen]
        self._mains = [main for layer in layers for p in layer.parameters() for main in self.main_params.of(p)]
        if self.skips_weight_grads:
            for layer in self.layers:
                trains = layer.layer_number - 1 not in frozen
                for p in layer.parameters():
                    p.requires_grad_(trains)
                    if not trains:
                        p.grad = None

    def _dropping_frozen(self, prepare_grads):
        @functools.wraps(prepare_grads)
        def prepare_then_drop(*args, **kwargs):
            found_inf = prepare_grads(*args, **kwargs)
            for main in self._mains:
                main.grad = None
                if hasattr(main, "decoupled_grad"):
                    main.decoupled_grad = None
            return found_inf

        return prepare_then_drop
