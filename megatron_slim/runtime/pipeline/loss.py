"""Losses over slices, normalised per microbatch (Megatron's semantics), not per slice.

A Megatron loss function returns ``(loss_sum, num_tokens, report)``; Megatron divides each
microbatch's ``loss_sum`` by its ``num_tokens`` and by the number of microbatches (neither under
``calculate_per_token_loss``). Computing the loss slice by slice keeps only one slice's logits; the
division by the microbatch's token count waits until the microbatch's last slice is forwarded,
which the schedule guarantees before that microbatch's first backward on the last stage.

Context parallelism. This reproduces, per microbatch on each CP rank, what megatron-core 0.16.1's
``forward_step_calc_loss`` does to the loss of one whole microbatch on that rank:

* 3-tuple, default: ``loss_sum / clamp(num_tokens, 1) / num_microbatches``, where ``num_tokens``
  is what the loss function returned, summed over the slices: for megatron's ``pretrain_gpt``
  that is this CP rank's *local* count (no CP all-reduce, no ``cp`` factor);
* 3-tuple with ``calculate_per_token_loss``: neither division; the loss sum is back-propagated
  as it is; ``total_num_tokens`` (local, summed over slices and
  microbatches) goes to ``finalize_model_grads``, which all-reduces it over data x context
  parallel ranks and scales the gradients by its inverse;
* 2-tuple (legacy mean, one slice only): ``loss * cp_size / num_microbatches``.

Megatron's DDP then *averages* gradients over data x context parallel ranks (sums them when
``calculate_per_token_loss``). So the gradients equal the unsharded reference (mean over the
microbatch's loss tokens) when the loss function makes each rank's normalised loss
``cp * local_sum / total_count`` (``megatron.cp.data.cp_loss_func``: count all-reduced over
CP, sum times cp), with ``calculate_per_token_loss``, with the legacy 2-tuple returning the CP
group's mean, or when every CP rank holds the same number of loss tokens (all-ones masks).
With a stock local-count loss function and uneven masks megatron averages per-rank means; this
class does the same, and the value then also depends on which tokens a rank holds (SlimPipe's
per-slice zigzag differs from megatron's whole-sequence zigzag).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class _Microbatch:
    losses: dict = field(default_factory=dict)  # slice -> loss_sum tensor (in the graph)
    num_tokens: torch.Tensor | None = None
    reports: list = field(default_factory=list)  # (num_tokens, report) per slice
    slices_seen: int = 0


class SlicedLoss:
    def __init__(self, num_microbatches: int, num_slices: int, per_token_loss: bool, cp_size: int = 1) -> None:
        self.num_microbatches = num_microbatches
        self.num_slices = num_slices
        self.per_token_loss = per_token_loss
        self.cp_size = cp_size
        self._mbs: dict[int, _Microbatch] = {}
        self.total_num_tokens: torch.Tensor | None = None
        self.reports: list = []

    def add(self, microbatch: int, slice_: int, outputs, keep_graph: bool) -> None:
        if not isinstance(outputs, tuple) or len(outputs) not in (2, 3):
            raise TypeError(
                "loss_func must return (loss_sum, num_tokens, report) or, unsliced, (loss, report); "
                f"got {type(outputs).__name__}"
            )
        if len(outputs) == 2:
            if self.num_slices > 1:
                raise ValueError(
                    "a 2-tuple loss_func (mean loss, report) cannot be normalised per microbatch "
                    "over slices: return (loss_sum, num_tokens, report) as pretrain_gpt.py does"
                )
            loss, report = outputs
            num_tokens = torch.ones((), dtype=torch.int, device=loss.device)
        else:
            loss, num_tokens, report = outputs
        mb = self._mbs.setdefault(microbatch, _Microbatch())
        if slice_ != mb.slices_seen:
            raise RuntimeError(f"loss of microbatch {microbatch}: slice {slice_} after {mb.slices_seen} slices")
        mb.slices_seen += 1
        count = num_tokens.detach().reshape(())
        mb.num_tokens = count if mb.num_tokens is None else mb.num_tokens + count
        mb.reports.append((count, report))
        self._legacy_mean = len(outputs) == 2
        if keep_graph:
            mb.losses[slice_] = loss
        if mb.slices_seen == self.num_slices:
            so_far = self.total_num_tokens
            self.total_num_tokens = mb.num_tokens if so_far is None else so_far + mb.num_tokens
            self.reports.append(_combine_reports(mb.reports))
            mb.reports = []
            if not keep_graph:
                del self._mbs[microbatch]

    def backward_tensor(self, microbatch: int, slice_: int) -> torch.Tensor:
        """The slice's loss scaled as Megatron scales the microbatch's loss."""
        mb = self._mbs[microbatch]
        if mb.slices_seen != self.num_slices:
            raise RuntimeError(f"backward of microbatch {microbatch} slice {slice_} before its last slice's loss")
        loss = mb.losses.pop(slice_)
        if not mb.losses:
            del self._mbs[microbatch]
        if self._legacy_mean:
            return loss * self.cp_size / self.num_microbatches
        if self.per_token_loss:
            return loss
        assert mb.num_tokens is not None  # set by the slice's loss
        return loss / (torch.clamp(mb.num_tokens, min=1) * self.num_microbatches)

    def is_drained(self) -> bool:
        return not self._mbs


def _combine_reports(parts: list) -> Any:
    """Per-slice report dicts -> one per microbatch: 2-element [sum, count] values add up; other
    values are averaged weighted by the slice's token count."""
    reports = [r for _, r in parts]
    if not reports or not isinstance(reports[0], dict):
        return reports[0] if len(reports) == 1 else reports
    total = sum(float(c) for c, _ in parts) or 1.0
    out: dict[str, Any] = {}
    for name in reports[0]:
        values = [r[name] for r in reports]
        if torch.is_tensor(values[0]) and values[0].numel() == 2:
            out[name] = torch.stack([v.detach() for v in values]).sum(0)
        elif len(values) == 1:
            out[name] = values[0]
        else:
            weights = [float(c) / total for c, _ in parts]
            out[name] = sum(w * (v.detach() if torch.is_tensor(v) else v) for w, v in zip(weights, values))
    return out
