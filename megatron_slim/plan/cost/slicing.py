"""Slice policies: where a microbatch's sequence is cut into the slices SlimPipe pipelines.

* ``uniform``: equal slices. Under a causal mask later slices attend to longer prefixes, so they
  cost more: slice j of n does work ∝ linear + attention·(j + 1/2).
* ``balanced``: boundaries chosen so every slice's forward+backward time is equal. With a time
  per token ``a`` and per causal query-key pair ``b``, the work up to position X is
  ``C(X) = a·X + b·X(X+1)/2``; boundary k solves ``C(X_k) = k/n · C(S)``. Earlier slices come out
  longer. Boundaries are rounded to the alignment unit (zigzag CP chunks, SP shards).
"""

from __future__ import annotations

import math

from megatron_slim.plan.schema import fail


def slice_alignment(cp: int, tp: int = 1, sequence_parallel: bool = False) -> int:
    """Every slice boundary is a multiple of this many tokens: each slice is cut into ``2*cp``
    zigzag chunks and, under sequence parallelism, each CP shard into ``tp``."""
    return (2 * cp if cp > 1 else 1) * (tp if sequence_parallel else 1)


def is_aligned(length: int, alignment: int) -> bool:
    return length % alignment == 0


def splits_uniformly(seq_length: int, num_slices: int, alignment: int) -> bool:
    """``num_slices`` equal slices of ``seq_length``, each a multiple of ``alignment`` tokens."""
    return is_aligned(seq_length, num_slices * alignment)


def max_slices(seq_length: int, alignment: int) -> int:
    """The most slices of at least one ``alignment`` unit each."""
    return seq_length // alignment


def splits_aligned(seq_length: int, num_slices: int, alignment: int) -> bool:
    """``num_slices`` slices (not necessarily equal) of whole ``alignment`` units: what balanced slices need."""
    return is_aligned(seq_length, alignment) and num_slices <= max_slices(seq_length, alignment)


def uniform_slices(seq_length: int, num_slices: int, alignment: int = 1) -> tuple[int, ...]:
    if not splits_uniformly(seq_length, num_slices, alignment):
        raise fail(
            "schedule.num_slices",
            num_slices,
            f"a count that splits {seq_length} tokens into equal multiples of {alignment}",
        )
    return (seq_length // num_slices,) * num_slices


def balanced_slices(
    seq_length: int, num_slices: int, per_token: float, per_pair: float, alignment: int = 1
) -> tuple[int, ...]:
    if not splits_aligned(seq_length, num_slices, alignment):
        raise fail(
            "schedule.num_slices",
            num_slices,
            f"at most {max_slices(seq_length, alignment)} slices of {alignment}-token units",
        )
    if per_token < 0 or per_pair < 0 or per_token + per_pair <= 0:
        raise ValueError(
            f"balanced_slices: costs must be non-negative and not both zero "
            f"(got per_token={per_token}, per_pair={per_pair})"
        )
    units = seq_length // alignment

    def cost(x: float) -> float:
        return per_token * x + per_pair * x * (x + 1) / 2

    total = cost(seq_length)
    bounds = [0]
    for k in range(1, num_slices):
        target = total * k / num_slices
        if per_pair > 0:
            qa, qb = per_pair / 2, per_token + per_pair / 2
            x = (-qb + math.sqrt(qb * qb + 4 * qa * target)) / (2 * qa)
        else:
            x = target / per_token
        unit = round(x / alignment)
        # keep every slice at least one unit long, leaving room for the slices still to come
        unit = min(max(unit, bounds[-1] + 1), units - (num_slices - k))
        bounds.append(unit)
    bounds.append(units)
    return tuple((b - a) * alignment for a, b in zip(bounds, bounds[1:]))


def slice_prefixes(lengths: tuple[int, ...]) -> tuple[int, ...]:
    """Start position of each slice."""
    out, pos = [], 0
    for n in lengths:
        out.append(pos)
        pos += n
    return tuple(out)
