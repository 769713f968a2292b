"""Split each microbatch from a data iterator into sequence slices for the forward step.

A Megatron ``forward_step_func`` calls ``next(data_iterator)`` once per forward; under SlimPipe a
forward is one slice, so the wrapper reads one microbatch from the wrapped iterator at its first
slice and hands out the slices in order. Batches are dicts of ``[b, s, ...]`` tensors (Megatron's
``tokens``, ``labels``, ``loss_mask``, ``position_ids``) or plain tensors. A causal
``attention_mask`` ``[b, 1, s, s]`` becomes the slice's own causal block ``[b, 1, n, n]`` (the K/V
cache attention is causal by construction and ignores it, but Megatron's tensor-parallel batch
broadcast sends whatever TP rank 0 read, so it must keep its slice shape); any other mask is
refused rather than silently ignored. Slices are contiguous copies: loss functions flatten them
with ``view(-1)`` (Megatron-Bridge's ``masked_next_token_loss``), which a column slice of a
``[b > 1, s]`` tensor does not allow.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional, Sequence

import torch


def _causal_rows(mask: torch.Tensor, start: int, length: int) -> bool:
    """Megatron's boolean mask marks *masked* positions; a causal mask masks exactly the keys after
    each query. Checks only the slice's rows (up to its last key)."""
    rows = mask[..., start : start + length, : start + length]
    expected = torch.ones(length, start + length, dtype=torch.bool, device=mask.device).triu(start + 1)
    return mask.dtype == torch.bool and bool((rows == expected).all())


def slice_batch(batch: Any, start: int, length: int) -> Any:
    if torch.is_tensor(batch):
        return batch[:, start : start + length].contiguous()
    if isinstance(batch, dict):
        out = {}
        for name, value in batch.items():
            if name == "attention_mask" and value is not None:
                if not _causal_rows(value, start, length):
                    raise ValueError(
                        "attention_mask: SlimPipe slices support only the plain causal mask "
                        "(no --reset-attention-mask / document masking); got a different mask"
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

    def __init__(self, source: Optional[Iterator], lengths: Sequence[int]) -> None:
        self.source = source
        self.lengths = list(lengths)
        self.starts = [sum(self.lengths[:j]) for j in range(len(self.lengths))]
        self._batch = None
        self._next_slice = 0

    def __iter__(self) -> "SlicedIterator":
        return self

    def __next__(self) -> Any:
        if self._next_slice == 0:
            assert self.source is not None, "a SlicedIterator without a source has no slices"
            self._batch = next(self.source)
            _check_length(self._batch, sum(self.lengths))
        j = self._next_slice
        part = slice_batch(self._batch, self.starts[j], self.lengths[j])
        self._next_slice = (j + 1) % len(self.lengths)
        if self._next_slice == 0:
            self._batch = None
        return part


def _check_length(batch: Any, expected: int) -> None:
    tensors = (
        [batch]
        if torch.is_tensor(batch)
        else [v for k, v in batch.items() if torch.is_tensor(v) and v.dim() >= 2 and k != "attention_mask"]
    )
    for t in tensors:
        if t.shape[1] != expected:
            raise ValueError(
                f"batch sequence length {t.shape[1]} differs from the slice plan's {expected} tokens "
                "(--seq-length / model.seq_length)"
            )
