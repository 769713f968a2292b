"""Layer freezing (``--dynmo-freeze``) inside Megatron-LM's loop, without touching ``requires_grad``.

``megatron-slim train`` freezes by ``requires_grad = False`` (``train.dynmo.freeze``). Under
Megatron's DDP that is not safe mid-run: the gradient buffers and buckets were laid out for the
parameters that required gradients at wrap time, a bucket's reduction starts once every one of its
parameters reported a gradient (with ``--overlap-grad-reduce`` a frozen parameter would leave it
waiting forever), and the distributed optimizer's shards map onto those buffers. Rebuilding DDP and
the optimizer would lose their state. So the frozen layers keep computing weight gradients, which
DDP reduces as before, and they are dropped where the optimizer takes them:

after Megatron's ``prepare_grads`` has copied the reduced gradients onto the main parameters (and
unscaled them), each frozen layer's main parameters get ``.grad = None`` (``decoupled_grad`` too).
Megatron's gradient norm and clipping then leave them out (they skip parameters without a
gradient, as ``megatron-slim train`` does for frozen layers), and the inner Adam/AdamW skips them
entirely. Zeroing the gradient would not be enough: Adam would still move the weights by its
moments and by weight decay. Their main parameters, moments and step count therefore stay as they
were, and the copy from main to model parameters writes back the same values: the frozen weights
are bit-identical from the freeze point on, on every data-parallel rank.
"""

from __future__ import annotations

import functools

from megatron_slim.megatron.dynmo.main_params import MainParams, sub_optimizers


def decoder_layers_of(model) -> list:
    """Megatron's ``TransformerLayer`` modules of the built (possibly DDP-wrapped) model chunks, in
    order; ``layer.layer_number - 1`` is a layer's global index."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    return [m for chunk in model for m in chunk.modules() if isinstance(m, TransformerLayer)]


class FrozenLayers:
    """Drops the frozen layers' gradients at every step of ``optimizer``."""

    def __init__(self, model, optimizer, main_params: MainParams) -> None:
        self.layers = decoder_layers_of(model)
        self.main_params = main_params
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
