"""Differentiable attention: thin ``autograd.Function``s over a backend's forward/backward.

They save (q, k, v, out, lse) and call the backend's own backward, so no score matrix is
kept alive between forward and backward. The returned lse is not differentiable.
"""

from __future__ import annotations

import torch

from megatron_slim.runtime.attention.backend import AttentionBackend
from megatron_slim.runtime.attention.selection import select_backend

Tensor = torch.Tensor


def _resolve(backend: AttentionBackend | str | None, q: Tensor) -> AttentionBackend:
    if backend is None or isinstance(backend, str):
        return select_backend(backend, device=q.device, dtype=q.dtype)
    return backend


class AttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal: bool, softmax_scale, backend: AttentionBackend):
        out, lse = backend.forward(q, k, v, causal=causal, softmax_scale=softmax_scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.softmax_scale, ctx.backend = causal, softmax_scale, backend
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.backend.backward(
            dout.contiguous(), q, k, v, out, lse, causal=ctx.causal, softmax_scale=ctx.softmax_scale
        )
        return dq, dk, dv, None, None, None


class VarlenAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q: int,
        max_seqlen_k: int,
        causal: bool,
        softmax_scale,
        backend: AttentionBackend,
    ):
        out, lse = backend.varlen_forward(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            causal=causal,
            softmax_scale=softmax_scale,
        )
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
        ctx.max_seqlen_q, ctx.max_seqlen_k = max_seqlen_q, max_seqlen_k
        ctx.causal, ctx.softmax_scale, ctx.backend = causal, softmax_scale, backend
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        dq, dk, dv = ctx.backend.varlen_backward(
            dout.contiguous(),
            q,
            k,
            v,
            out,
            lse,
            cu_q,
            cu_k,
            ctx.max_seqlen_q,
            ctx.max_seqlen_k,
            causal=ctx.causal,
            softmax_scale=ctx.softmax_scale,
        )
        return dq, dk, dv, None, None, None, None, None, None, None


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool = True,
    softmax_scale: float | None = None,
    backend: AttentionBackend | str | None = None,
    *,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Dense attention, q ``[b, sq, hq, d]``, k/v ``[b, sk, hkv, d]``; bottom-right causal.

    ``backend``: an instance, a name, or None for ``select_backend(device=q.device, dtype=q.dtype)``.
    """
    out, lse = AttentionFunction.apply(q, k, v, bool(causal), softmax_scale, _resolve(backend, q))
    return (out, lse) if return_lse else out


def varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool = True,
    softmax_scale: float | None = None,
    backend: AttentionBackend | str | None = None,
    *,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Packed attention, q ``[total_q, hq, d]``, k/v ``[total_k, hkv, d]``; causal per sequence."""
    out, lse = VarlenAttentionFunction.apply(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        int(max_seqlen_q),
        int(max_seqlen_k),
        bool(causal),
        softmax_scale,
        _resolve(backend, q),
    )
    return (out, lse) if return_lse else out
