"""Plain torch math attention: the source of truth, on any device and floating dtype.

Materialises the full ``[b, hq, sq, sk]`` score matrix in at least float32 (float64 inputs
stay float64), so it is for tests, CPU runs and odd shapes, not for long sequences.
"""

from __future__ import annotations

import torch

from megatron_slim.runtime.attention.backend import AttentionBackend
from megatron_slim.runtime.attention.checks import check_dense, resolve_softmax_scale

Tensor = torch.Tensor


def bottom_right_causal_mask(sq: int, sk: int, device: torch.device | str | None = None) -> Tensor:
    """Bool ``[sq, sk]``, True where query row i may see key j, i.e. ``j <= i + (sk - sq)``."""
    rows = torch.arange(sq, device=device).unsqueeze(1)
    cols = torch.arange(sk, device=device).unsqueeze(0)
    return cols <= rows + (sk - sq)


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _grouped(x: Tensor, hkv: int, acc: torch.dtype) -> Tensor:
    """``[b, s, hq, d]`` -> ``[b, s, hkv, g, d]``: query head ``h*g + j`` uses kv head ``h``."""
    b, s, hq, d = x.shape
    return x.to(acc).reshape(b, s, hkv, hq // hkv, d)


def _probabilities(q: Tensor, k: Tensor, lse: Tensor | None, causal: bool, scale: float):
    """Scores -> (probabilities ``[b, hkv, g, sq, sk]``, lse ``[b, hkv, g, sq]``).

    With ``lse`` given (backward), probabilities are normalised by it rather than recomputed,
    so a key block can be differentiated against the softmax statistics of a larger key set.
    """
    scores = torch.einsum("bqhgd,bkhd->bhgqk", q, k) * scale
    if causal:
        visible = bottom_right_causal_mask(q.shape[1], k.shape[1], q.device)
        scores = scores.masked_fill(~visible, float("-inf"))
    if lse is None:
        lse = torch.logsumexp(scores, dim=-1)
    # A row that sees no key has lse = -inf; subtracting 0 instead makes its probabilities 0.
    finite_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return torch.exp(scores - finite_lse.unsqueeze(-1)), lse


class ReferenceBackend(AttentionBackend):
    name = "reference"

    def unsupported_reason(self, device: torch.device, dtype: torch.dtype | None = None) -> str | None:
        if dtype is not None and not dtype.is_floating_point:
            return f"dtype {dtype} is not floating-point"
        return None

    def forward(self, q, k, v, *, causal, softmax_scale=None):
        check_dense(q, k, v, causal)
        scale = resolve_softmax_scale(softmax_scale, q.shape[-1])
        b, sq, hq, _ = q.shape
        hkv = k.shape[2]
        acc = _accumulation_dtype(q.dtype)
        p, lse = _probabilities(_grouped(q, hkv, acc), k.to(acc), None, causal, scale)
        out = torch.einsum("bhgqk,bkhd->bqhgd", p, v.to(acc))
        out = out.reshape(b, sq, hq, v.shape[-1]).to(q.dtype)
        return out, lse.reshape(b, hq, sq).float()

    def backward(self, dout, q, k, v, out, lse, *, causal, softmax_scale=None):
        check_dense(q, k, v, causal)
        scale = resolve_softmax_scale(softmax_scale, q.shape[-1])
        b, sq, hq, _ = q.shape
        hkv = k.shape[2]
        acc = _accumulation_dtype(q.dtype)
        qg, kf, vf = _grouped(q, hkv, acc), k.to(acc), v.to(acc)
        dout_g, out_g = _grouped(dout, hkv, acc), _grouped(out, hkv, acc)
        lse_g = lse.to(acc).reshape(b, hkv, hq // hkv, sq)
        p, _ = _probabilities(qg, kf, lse_g, causal, scale)
        dv = torch.einsum("bhgqk,bqhgd->bkhd", p, dout_g)
        dp = torch.einsum("bqhgd,bkhd->bhgqk", dout_g, vf)
        # softmax backward: dS = P * (dP - rowsum(dO * O)), with O the (possibly merged) output.
        delta = (dout_g * out_g).sum(-1).permute(0, 2, 3, 1)
        ds = p * (dp - delta.unsqueeze(-1)) * scale
        dq = torch.einsum("bhgqk,bkhd->bqhgd", ds, kf).reshape(q.shape)
        dk = torch.einsum("bhgqk,bqhgd->bkhd", ds, qg)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
