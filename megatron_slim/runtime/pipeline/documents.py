"""Packed windows under SlimPipe: which documents a slice's queries and keys belong to.

A microbatch window (``b = 1``, ``s`` tokens) may be a pack of documents, given by the batch key
``"document_lengths"`` (a tuple of ints summing to ``s``; trailing padding is one more document),
by Megatron's block-causal ``--reset-attention-mask`` mask, or by the THD offsets Megatron's data
path puts in the batch (``cu_seqlens``, optionally ``cu_seqlens_padded``: ``--sft`` packs, 0.19's
``--dataloader-inter-document-masking``), from which ``pretrain_gpt.get_batch`` would build
``PackedSeqParams``. A token attends to the earlier
tokens of its own document only, and its rotary position restarts at 0 in each document.

A slice ``[start, end)`` therefore reads keys from the start of the document holding ``start``
onwards, never the cached chunks before it; every document it touches has its query tokens at the
end of its key range, which is the varlen kernels' bottom-right causal mask per sequence
(:class:`SliceDocuments`). The data iterator records each microbatch's lengths in the run's
:class:`DocumentTable` (on ``SliceContext.documents``); attention and RoPE look them up by the
current microbatch.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Optional

import torch

DOCUMENT_LENGTHS = "document_lengths"
THD_OFFSETS = "cu_seqlens"
THD_KEYS = (THD_OFFSETS, "cu_seqlens_padded", "max_seqlen")  # the window's THD description, not sliced


@dataclass(frozen=True)
class SliceDocuments:
    """The documents slice ``[start, start + length)`` touches, cut to what it attends."""

    key_start: int  # first key position any query of the slice reads
    q_lengths: tuple[int, ...]  # per document touched: its tokens inside the slice
    k_lengths: tuple[int, ...]  # per document touched: its tokens in [key_start, slice end)

    def cu_seqlens(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        def cumulative(lengths: tuple[int, ...]) -> torch.Tensor:
            return torch.tensor([0, *accumulate(lengths)], dtype=torch.int32, device=device)

        return cumulative(self.q_lengths), cumulative(self.k_lengths)


def check_document_lengths(lengths: Any, total: int) -> tuple[int, ...]:
    """``lengths`` as a tuple of positive ints summing to the window's ``total`` tokens."""
    if not isinstance(lengths, (tuple, list)) or not all(isinstance(n, int) and n > 0 for n in lengths):
        raise ValueError(
            f"{DOCUMENT_LENGTHS}={lengths!r}: allowed: a tuple of positive ints, the window's documents in order"
        )
    if sum(lengths) != total:
        raise ValueError(
            f"{DOCUMENT_LENGTHS}={tuple(lengths)} sum to {sum(lengths)} tokens; allowed: lengths summing to the "
            f"window's {total} tokens (trailing padding counts as one more document)"
        )
    return tuple(lengths)


def _window_offsets(name: str, value: Any) -> list[int]:
    """A window's offsets from a ``[k]`` or ``[1, k]`` integer tensor (one ``b = 1`` window)."""
    rows = value.shape[0] if torch.is_tensor(value) and value.dim() == 2 else 1
    if not torch.is_tensor(value) or value.dim() not in (1, 2) or rows != 1 or value.is_floating_point():
        shape = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
        raise ValueError(
            f"{name}={shape}: allowed: one window's offsets, a [k] or [1, k] integer tensor (micro-batch size 1)"
        )
    offsets = [int(x) for x in value.reshape(-1).tolist()]
    if len(offsets) < 2 or offsets[0] != 0 or any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"{name}={offsets}: allowed: at least two offsets, starting at 0, non-decreasing")
    return offsets


def lengths_from_thd_offsets(cu_seqlens: Any, cu_seqlens_padded: Any, total: int) -> tuple[int, ...]:
    """Document lengths of a window described by Megatron's THD offsets. A sequence's slot (from
    ``cu_seqlens_padded`` where given) is one document: its padding follows its real tokens, so causal
    attention keeps the real tokens blind to it (padding rows carry loss mask 0)."""
    real = _window_offsets(THD_OFFSETS, cu_seqlens)
    slots = _window_offsets("cu_seqlens_padded", cu_seqlens_padded) if cu_seqlens_padded is not None else real
    if len(slots) != len(real) or any(b - a > d - c for a, b, c, d in zip(real, real[1:], slots, slots[1:])):
        raise ValueError(
            f"cu_seqlens={real}, cu_seqlens_padded={slots}: allowed: as many padded offsets, each slot at least "
            "as long as its sequence"
        )
    if slots[-1] != total:
        raise ValueError(f"{THD_OFFSETS}: offsets end at {slots[-1]}; allowed: the window's {total} tokens")
    return tuple(b - a for a, b in zip(slots, slots[1:]) if b > a)


def _document_starts(lengths: tuple[int, ...]) -> list[int]:
    return [0, *accumulate(lengths)][:-1]


def slice_documents(lengths: tuple[int, ...], start: int, length: int) -> SliceDocuments:
    end = start + length
    starts = _document_starts(lengths)
    first = bisect_right(starts, start) - 1
    q_lengths, k_lengths = [], []
    for d in range(first, len(lengths)):
        doc_start, doc_end = starts[d], starts[d] + lengths[d]
        if doc_start >= end:
            break
        q_lengths.append(min(doc_end, end) - max(doc_start, start))
        k_lengths.append(min(doc_end, end) - doc_start)
    return SliceDocuments(starts[first], tuple(q_lengths), tuple(k_lengths))


def slice_positions(lengths: tuple[int, ...], start: int, length: int) -> list[int]:
    """Each slice token's position inside its own document."""
    starts = _document_starts(lengths)
    return [i - starts[bisect_right(starts, i) - 1] for i in range(start, start + length)]


def lengths_from_block_mask(mask: torch.Tensor) -> Optional[tuple[int, ...]]:
    """Document lengths of Megatron's ``--reset-attention-mask`` mask ``[1, 1, s, s]`` (True =
    masked), or None if ``mask`` is not exactly block-causal over contiguous documents."""
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[:2] != (1, 1) or mask.shape[2] != mask.shape[3]:
        return None
    visible = ~mask[0, 0]
    s = visible.shape[0]
    first_visible = visible.int().argmax(dim=1)  # row i sees keys first_visible[i] .. i
    rows = torch.arange(s, device=mask.device)
    starts = rows[first_visible == rows].tolist()
    if not starts or starts[0] != 0:
        return None
    lengths = tuple(b - a for a, b in zip(starts, starts[1:] + [s]))
    expected = (rows[None, :] >= first_visible[:, None]) & (rows[None, :] <= rows[:, None])
    return lengths if bool((visible == expected).all()) else None


class DocumentTable:
    """Each microbatch's document lengths in the current schedule call (absent: one document)."""

    def __init__(self) -> None:
        self._lengths: dict[int, tuple[int, ...]] = {}

    def clear(self) -> None:
        self._lengths.clear()

    def record(self, microbatch: int, lengths: tuple[int, ...]) -> None:
        known = self._lengths.setdefault(microbatch, lengths)
        if known != lengths:
            raise ValueError(
                f"{DOCUMENT_LENGTHS} of microbatch {microbatch}: {lengths} read after {known}; allowed: every "
                "model chunk reads the same documents for a microbatch"
            )

    def lookup(self, microbatch: int) -> Optional[tuple[int, ...]]:
        return self._lengths.get(microbatch)
