"""Causal attention of one slice against the K/V cache of the earlier slices.

Forward: the slice's queries attend causally to its own keys (a square causal block) and fully
to every cached chunk of earlier slices; partial results merge by log-sum-exp. No concatenated
copy of the prefix is made. Backward (slices run in reverse): with the merged output and
log-sum-exp, each block's gradient is exact on its own: dQ sums over blocks, the prefix blocks'
dK/dV go into the store's buffers of those slices, and this slice's own dK/dV gets the buffer the
later slices filled. Then the slice's cache chunk is released.
"""
from __future__ import annotations

import torch

from megatron_slim.runtime.attention import AttentionBackend, merge_
from megatron_slim.runtime.pipeline.kv_cache import KVCacheStore
from megatron_slim.runtime.pipeline.slice_context import SliceInfo


class _SliceAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, backend: AttentionBackend, scale: float, store: KVCacheStore,
                info: SliceInfo, layer: int):
        out, lse = backend.forward(q, k, v, causal=True, softmax_scale=scale)
        for k_i, v_i in store.prefix(info.microbatch, layer, info.slice):
            out_i, lse_i = backend.forward(q, k_i, v_i, causal=False, softmax_scale=scale)
            out, lse = _merged(out, lse, out_i, lse_i)
        out = out.to(q.dtype)
        store.append(info.microbatch, layer, info.slice, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.meta = (backend, scale, store, info, layer)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        backend, scale, store, info, layer = ctx.meta
        dout = dout.contiguous()
        dq, dk, dv = backend.backward(dout, q, k, v, out, lse, causal=True, softmax_scale=scale)
        dq = dq.float()
        for i, (k_i, v_i) in enumerate(store.prefix(info.microbatch, layer, info.slice)):
            dq_i, dk_i, dv_i = backend.backward(dout, q, k_i, v_i, out, lse, causal=False, softmax_scale=scale)
            dq += dq_i
            store.accumulate(info.microbatch, layer, i, dk_i, dv_i)
        later = store.take_gradient(info.microbatch, layer, info.slice)
        if later is not None:
            dk = (dk.float() + later[0]).to(k.dtype)
            dv = (dv.float() + later[1]).to(v.dtype)
        store.release(info.microbatch, layer, info.slice)
        return dq.to(q.dtype), dk, dv, None, None, None, None, None


def _merged(out, lse, out_i, lse_i):
    out, lse = out.float().clone(), lse.clone()
    merge_(out, lse, out_i, lse_i)
    return out, lse


def sliced_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, backend: AttentionBackend,
                     softmax_scale: float, store: KVCacheStore, info: SliceInfo, layer: int) -> torch.Tensor:
    """``q [b, s, hq, d]``, ``k``/``v [b, s, hkv, d]`` of slice ``info.slice`` -> ``[b, s, hq, d]``.

    K and V are made contiguous first: they stay in the cache until this slice's backward, and a
    view would keep the whole fused QKV projection output alive with them.
    """
    k, v = k.contiguous(), v.contiguous()
    if not torch.is_grad_enabled() or not (q.requires_grad or k.requires_grad or v.requires_grad):
        with torch.no_grad():
            out, lse = backend.forward(q, k, v, causal=True, softmax_scale=softmax_scale)
            for k_i, v_i in store.prefix(info.microbatch, layer, info.slice):
                out, lse = _merged(out, lse, *backend.forward(q, k_i, v_i, causal=False, softmax_scale=softmax_scale))
            store.append(info.microbatch, layer, info.slice, k, v)
        return out.to(q.dtype)
    out = _SliceAttention.apply(q, k, v, backend, softmax_scale, store, info, layer)
    return out.to(q.dtype)
