"""Combine attention partials computed over disjoint key sets, by log-sum-exp.

For one query row with partials (o_a, l_a) over keys A and (o_b, l_b) over keys B, the
attention over A u B is ``l = log(e^l_a + e^l_b)`` and ``o = e^(l_a - l) o_a + e^(l_b - l) o_b``.
Works for both layouts: dense (out ``[b, s, h, d]``, lse ``[b, h, s]``) and varlen
(out ``[t, h, d]``, lse ``[h, t]``), since in both lse is out's ``[..., s, h]`` transposed.
A partial whose row saw no key has lse = -inf and contributes nothing (its out is ignored,
even if NaN); a row no partial saw gets out = 0, lse = -inf.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def _check(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> None:
    if out_a.shape != out_b.shape:
        raise ValueError(f"out_a {tuple(out_a.shape)} and out_b {tuple(out_b.shape)} must have equal shapes")
    if lse_a.shape != lse_b.shape:
        raise ValueError(f"lse_a {tuple(lse_a.shape)} and lse_b {tuple(lse_b.shape)} must have equal shapes")
    expected = (*out_a.shape[:-3], out_a.shape[-2], out_a.shape[-3])
    if tuple(lse_a.shape) != expected:
        raise ValueError(f"lse shape {tuple(lse_a.shape)} does not match out {tuple(out_a.shape)}: expected {expected}")


def _weights(lse_a: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """fp32 weights of each partial, broadcastable to out, and the merged lse."""
    lse_a, lse_b = lse_a.float(), lse_b.float()
    top = torch.maximum(lse_a, lse_b)
    # Both -inf: shift by 0 so the weights are exp(-inf) = 0 rather than NaN.
    top = torch.where(torch.isneginf(top), torch.zeros_like(top), top)
    w_a, w_b = torch.exp(lse_a - top), torch.exp(lse_b - top)
    total = w_a + w_b
    lse = top + torch.log(total)  # log(0) = -inf for rows no partial saw
    inv = torch.where(total > 0, 1.0 / total, torch.zeros_like(total))

    def like_out(w: Tensor) -> Tensor:  # lse [..., h, s] -> [..., s, h, 1]
        return (w * inv).transpose(-1, -2).unsqueeze(-1)

    return like_out(w_a), like_out(w_b), lse


def _weighted(w: Tensor, out: Tensor) -> Tensor:
    return torch.where(w > 0, w * out.float(), torch.zeros((), dtype=torch.float32, device=out.device))


def merge(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Merged (out in out_a's dtype, lse float32) of two partials over disjoint key sets."""
    _check(out_a, lse_a, out_b, lse_b)
    w_a, w_b, lse = _weights(lse_a, lse_b)
    out = _weighted(w_a, out_a) + _weighted(w_b, out_b)
    return out.to(out_a.dtype), lse


def merge_(out_acc: Tensor, lse_acc: Tensor, out_new: Tensor, lse_new: Tensor) -> tuple[Tensor, Tensor]:
    """In-place accumulate: fold (out_new, lse_new) into (out_acc, lse_acc) and return them.

    Keep the accumulators in float32 when many partials are folded in; a low-precision
    accumulator rounds once per step.
    """
    _check(out_acc, lse_acc, out_new, lse_new)
    w_acc, w_new, lse = _weights(lse_acc, lse_new)
    out_acc.copy_(_weighted(w_acc, out_acc) + _weighted(w_new, out_new))
    lse_acc.copy_(lse)
    return out_acc, lse_acc
