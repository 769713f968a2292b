"""Where a pack's sequence lengths come from: the documents a CP engine attends within.

A context-parallel engine plans per *sequence* (THD semantics): each sequence attends causally to
itself only and its positions restart at 0. Every CP rank of a group must derive the same lengths
from the same microbatch (they read the same data), so these functions are pure and look only at
the batch itself. Three sources, in this order:

1. ``cu_seqlens`` (or ``packed_seq_params.cu_seqlens_q``): cumulative boundaries, as Megatron-LM's
   packed (SFT / THD) data gives them. Repeated boundaries (empty sequences, padding of the
   ``cu_seqlens`` tensor itself) are dropped; the last boundary must be the pack length.
2. ``position_ids`` that restart (``--reset-position-ids``): a new sequence begins wherever a
   position is not its predecessor plus one (Megatron resets them after every ``eod`` token).
3. Otherwise the whole row is one sequence (plain causal attention over the window).

``document_lengths`` is the training job's form of 2: documents end at (and include) each
``eod`` token, as Megatron's ``--reset-position-ids --reset-attention-mask`` would cut them.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch


def _row(value: torch.Tensor, name: str) -> torch.Tensor:
    if value.dim() == 2 and value.shape[0] == 1:
        return value[0]
    if value.dim() != 1:
        raise ValueError(
            f"{name} has shape {tuple(value.shape)}; allowed: [L] or [1, L] (one pack per "
            "microbatch: --micro-batch-size 1)"
        )
    return value


def lengths_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> tuple[int, ...]:
    """Sequence lengths of cumulative boundaries ``[0, s0, s0+s1, ..., total]``."""
    bounds = [int(x) for x in _row(cu_seqlens, "cu_seqlens").tolist()]
    if not bounds or bounds[0] != 0:
        raise ValueError(f"cu_seqlens starts at {bounds[0] if bounds else None}; allowed: boundaries starting at 0")
    lengths, previous = [], 0
    for b in bounds[1:]:
        if b < previous:
            break  # padding of the boundary tensor itself (e.g. a -1 fill) after the last sequence
        if b > previous:
            lengths.append(b - previous)
        previous = b
    if previous != total:
        raise ValueError(
            f"cu_seqlens ends at {previous} tokens, the pack holds {total}; allowed: boundaries "
            f"ending at the pack length {total}"
        )
    return tuple(lengths)


def lengths_from_position_ids(position_ids: torch.Tensor) -> tuple[int, ...]:
    """A sequence starts at index 0 and wherever ``position_ids[i] != position_ids[i-1] + 1``."""
    pos = _row(position_ids, "position_ids")
    if pos.numel() == 0:
        raise ValueError("position_ids is empty; allowed: one pack of at least one token")
    starts = torch.nonzero(pos[1:] != pos[:-1] + 1).reshape(-1).add(1).tolist()
    bounds = [0] + starts + [int(pos.numel())]
    return tuple(b - a for a, b in zip(bounds, bounds[1:]))


def document_lengths(tokens: torch.Tensor, eod: int) -> tuple[int, ...]:
    """Documents of a window of tokens: each ends at (and includes) an ``eod`` token; the window's
    first and last documents may be cut by the window."""
    row = _row(tokens, "tokens")
    total = int(row.numel())
    ends = torch.nonzero(row == eod).reshape(-1).add(1).tolist()
    bounds = [0] + [e for e in ends if e < total] + [total]
    return tuple(b - a for a, b in zip(bounds, bounds[1:]))


def _cu_seqlens_of(batch: Mapping[str, Any]) -> Optional[torch.Tensor]:
    cu = batch.get("cu_seqlens")
    if torch.is_tensor(cu) and cu.numel() > 0:
        return cu
    params = batch.get("packed_seq_params")
    cu = getattr(params, "cu_seqlens_q", None)
    return cu if torch.is_tensor(cu) and cu.numel() > 0 else None


def pack_lengths(batch: Mapping[str, Any]) -> tuple[tuple[int, ...], str]:
    """``(lengths, source)`` of a Megatron batch dict (see the module docstring for the order);
    ``source`` is ``"cu_seqlens"``, ``"position_ids"`` or ``"row"``."""
    tokens = batch.get("tokens")
    if not torch.is_tensor(tokens):
        raise ValueError(
            "batch has no 'tokens' tensor: context-parallel engines need the pack on every CP rank "
            "(pipeline stages other than the first and last are not supported)"
        )
    total = int(_row(tokens, "tokens").numel())
    cu = _cu_seqlens_of(batch)
    if cu is not None:
        return lengths_from_cu_seqlens(cu, total), "cu_seqlens"
    pos = batch.get("position_ids")
    if torch.is_tensor(pos):
        lengths = lengths_from_position_ids(pos)
        if sum(lengths) != total:
            raise ValueError(
                f"position_ids hold {sum(lengths)} positions, tokens {total}; allowed: one position per token"
            )
        return lengths, "position_ids"
    return (total,), "row"
