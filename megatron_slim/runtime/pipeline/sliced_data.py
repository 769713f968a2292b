"""Split each microbatch from a data iterator into sequence slices for the forward step.

A Megatron ``forward_step_func`` calls ``next(data_iterator)`` once per forward; under SlimPipe a
forward is one slice, so the wrapper reads one microbatch from the wrapped iterator at its first
slice and hands out the slices in order. Batches are dicts of ``[b, s, ...]`` tensors (Megatron's
``tokens``, ``labels``, ``loss_mask``, ``position_ids``) or plain tensors. A causal
``attention_mask`` ``[b, 1, s, s]`` becomes the slice's own causal block ``[b, 1, n, n]`` (the K/V
cache attention is causal by construction and ignores it, but Megatron's tensor-parallel batch
broadcast sends whatever TP rank 0 read, so it must keep its slice shape); any other mask is
refused rather than silently ignored, except Megatron's block-causal document mask
(``--reset-attention-mask``) of a ``b = 1`` window: it is read as the window's document lengths,
exactly like the batch key ``document_lengths`` (a tuple of ints, passed through to every slice), and
so are Megatron's THD offsets (``cu_seqlens``, ``cu_seqlens_padded``; ``--sft`` and 0.19's
``--dataloader-inter-document-masking`` batches). Those describe the whole window, so the slices do
not carry them (nor ``max_seqlen``): ``pretrain_gpt.get_batch`` then builds no ``PackedSeqParams``
for a slice and the slice attention keeps the documents apart through the K/V cache instead.
The iterator records those lengths for the current microbatch in ``SliceContext.documents``, where
the slice attention and RoPE find them (``runtime/pipeline/documents.py``). Slices are contiguous
copies: loss functions flatten them with ``view(-1)`` (Megatron-Bridge's ``masked_next_token_loss``),
which a column slice of a ``[b > 1, s]`` tensor does not allow.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional, Sequence

import torch

from megatron_slim.runtime.pipeline.documents import (
    DOCUMENT_LENGTHS,
    THD_KEYS,
    THD_OFFSETS,
    check_document_lengths,
    lengths_from_block_mask,
    lengths_from_thd_offsets,
)
from megatron_slim.runtime.pipeline.slice_context import SliceContext


def _causal_rows(mask: torch.Tensor, start: int, length: int) -> bool:
    """Megatron's boolean mask marks *masked* positions; a causal mask masks exactly the keys after
    each query. Checks only the slice's rows (up to its last key)."""
    rows = mask[..., start : start + length, : start + length]
    expected = torch.ones(length, start + length, dtype=torch.bool, device=mask.device).triu(start + 1)
    return mask.dtype == torch.bool and bool((rows == expected).all())


def slice_batch(batch: Any, start: int, length: int, documents: bool = False) -> Any:
    """``documents``: the window is a pack whose document lengths were read from (or checked
    against) its attention mask, so the mask need not be plain causal."""
    if torch.is_tensor(batch):
        return batch[:, start : start + length].contiguous()
    if isinstance(batch, dict):
        out = {}
        for name, value in batch.items():
            if name in THD_KEYS and value is not None:
                continue  # the window's offsets: recorded as its documents (batch_documents)
            if name == "attention_mask" and value is not None:
                if not documents and not _causal_rows(value, start, length):
                    raise ValueError(
                        "attention_mask: SlimPipe slices support the plain causal mask and, for micro-batch "
                        "size 1, Megatron's block-causal document mask (--reset-attention-mask); got neither. "
                        f"Allowed alternative: the batch key {DOCUMENT_LENGTHS!r} (a tuple of document lengths)"
                    )
                out[name] = value[..., start : start + length, start : start + length]
            elif torch.is_tensor(value) and value.dim() >= 2:
                out[name] = value[:, start : start + length].contiguous()
            else:
                out[name] = value
        return out
    raise TypeError(
        f"cannot slice a batch of type {type(batch).__name__}: expected a dict of [b, s] tensors or a tensor"
    )


class SlicedIterator:
    """Yields the slices of each microbatch of ``source`` in order (slice 0, 1, ..., n-1)."""

    def __init__(
        self, source: Optional[Iterator], lengths: Sequence[int], context: Optional[SliceContext] = None
    ) -> None:
        self.source = source
        self.lengths = list(lengths)
        self.starts = [sum(self.lengths[:j]) for j in range(len(self.lengths))]
        self.context = context
        self._batch = None
        self._packed = False
        self._next_slice = 0

    def __iter__(self) -> "SlicedIterator":
        return self

    def __next__(self) -> Any:
        if self._next_slice == 0:
            assert self.source is not None, "a SlicedIterator without a source has no slices"
            self._batch = next(self.source)
            _check_length(self._batch, sum(self.lengths))
            self._packed = self._record_documents(self._batch)
        j = self._next_slice
        part = slice_batch(self._batch, self.starts[j], self.lengths[j], documents=self._packed)
        self._next_slice = (j + 1) % len(self.lengths)
        if self._next_slice == 0:
            self._batch = None
        return part

    def _record_documents(self, batch: Any) -> bool:
        """Record the window's document lengths for the current microbatch; True if it is a pack."""
        lengths = batch_documents(batch, sum(self.lengths))
        if lengths is None:
            return False
        context = self.context
        info = context.current if context is not None else None
        if context is None or info is None:
            raise ValueError(
                f"{DOCUMENT_LENGTHS}: a packed batch is read outside a SlimPipe slice (no SliceContext "
                "with a current slice); allowed: read it from the schedule's forward step"
            )
        context.documents.record(info.microbatch, lengths)
        return True


def batch_documents(batch: Any, total: int) -> Optional[tuple[int, ...]]:
    """The document lengths of a ``b = 1`` packed window: its ``document_lengths`` key, its
    block-causal attention mask or its THD offsets (``cu_seqlens``), which must agree where several
    are given; None for a plain window (one causal sequence)."""
    if not isinstance(batch, dict):
        return None
    found: dict[str, tuple[int, ...]] = {}
    if batch.get(DOCUMENT_LENGTHS) is not None:
        found[DOCUMENT_LENGTHS] = check_document_lengths(batch[DOCUMENT_LENGTHS], total)
    mask = batch.get("attention_mask")
    if torch.is_tensor(mask) and not _causal_rows(mask, 0, total):
        from_mask = lengths_from_block_mask(mask)
        if from_mask is None:
            return None  # slice_batch refuses the mask, naming the alternatives
        found["attention_mask"] = from_mask
    if batch.get(THD_OFFSETS) is not None:
        found[THD_OFFSETS] = lengths_from_thd_offsets(batch[THD_OFFSETS], batch.get("cu_seqlens_padded"), total)
    if not found:
        return None
    lengths = next(iter(found.values()))
    if any(other != lengths for other in found.values()):
        raise ValueError(
            f"the window's documents disagree: {found}; allowed: the same documents in every one of "
            f"{DOCUMENT_LENGTHS!r}, the attention mask and {THD_OFFSETS!r}"
        )
    rows = [v.shape[0] for k, v in batch.items() if torch.is_tensor(v) and v.dim() >= 2 and k != "attention_mask"]
    if any(b != 1 for b in rows):
        raise ValueError(
            f"{DOCUMENT_LENGTHS}: a packed window needs micro-batch size 1; got batch rows {sorted(set(rows))}. "
            "Allowed: --micro-batch-size 1 (pack documents into the window instead)"
        )
    return lengths


def _check_length(batch: Any, expected: int) -> None:
    tensors = (
        [batch]
        if torch.is_tensor(batch)
        else [
            v
            for k, v in batch.items()
            if torch.is_tensor(v) and v.dim() >= 2 and k != "attention_mask" and k not in THD_KEYS
        ]
    )
    for t in tensors:
        if t.shape[1] != expected:
            raise ValueError(
                f"batch sequence length {t.shape[1]} differs from the slice plan's {expected} tokens "
                "(--seq-length / model.seq_length)"
            )
