"""Layer freezing on a schedule (``dynmo.freeze``).

A frozen layer's parameters get ``requires_grad = False`` and no ``.grad``, so autograd computes only
the gradient of its input (its backward skips the weight gradients), and every consumer of ``.grad``
leaves it out: the data-parallel average and the norm skip parameters without a gradient, and
``torch.optim.AdamW`` skips them entirely (no moment update, no weight decay): their weights stay
bit-identical. The optimizer keeps whatever state they had, so nothing is lost if the schedule were
ever to thaw them.
"""

from __future__ import annotations

from megatron_slim.megatron.model.gpt import decoder_layers


def set_frozen(chunks, frozen: frozenset[int]) -> list[int]:
    """Freeze the decoder layers of ``chunks`` whose global index is in ``frozen`` and let the others
    train; returns the indices of this rank's layers whose state changed."""
    changed = []
    for layer in decoder_layers(chunks):
        trains = layer.layer_number - 1 not in frozen
        params = list(layer.parameters())
        if all(p.requires_grad == trains for p in params):
            continue
        changed.append(layer.layer_number - 1)
        for p in params:
            p.requires_grad_(trains)
            if not trains:
                p.grad = None
    return changed
