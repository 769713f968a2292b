"""Layer freezing on a schedule (``dynmo.freeze``).

A frozen layer's parameters get ``requires_grad = False`` and no ``.grad``, so autograd computes only
the gradient of its input (its backward skips the weight gradients), and every consumer of ``.grad``
leaves it out: the data-parallel average and the norm skip parameters without a gradient, and
``torch.optim.AdamW`` skips them entirely (no moment update, no weight decay): their weights stay
bit-identical. The optimizer keeps whatever state they had, so nothing is lost if the schedule were
ever to thaw them.

With the embedding frozen too (``dynmo.freeze_embedding``), a chunk below which nothing trains is
marked ``slim_input_needs_grad = False``: the stage runs its layers on a detached input, so a
stage of frozen layers builds no autograd graph and its backward is a zero input gradient
(``megatron.slimpipe.stage``) that keeps the schedule's sends and receives as they were.
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


def set_input_needs_grad(chunks, frozen: frozenset[int], embedding_frozen: bool) -> None:
    """Mark each chunk whether anything below its first layer trains (the embedding, or a layer)."""
    for chunk in chunks:
        below = range(chunk.slim_chunk_info.layers.start)
        chunk.slim_input_needs_grad = not embedding_frozen or any(layer not in frozen for layer in below)


def set_embedding_frozen(chunks, frozen: bool) -> None:
    for chunk in chunks:
        embedding = getattr(chunk, "embedding", None) if getattr(chunk, "pre_process", False) else None
        for p in embedding.parameters() if embedding is not None else ():
            p.requires_grad_(not frozen)
            if frozen:
                p.grad = None
