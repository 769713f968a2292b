"""Causal attention of one slice against the K/V cache of the earlier slices.

The slice's queries are the last ``s`` positions of the keys ``[prefix; own]``, which is exactly
the kernel library's bottom-right causal mask: one kernel call over the cached chunks joined with
the slice's own K/V, forward and backward. (One large call beats one call per cached chunk by a
wide margin, and the join is a transient copy of the prefix that the kernel reads anyway.) The
cache itself stays per slice. Backward runs slices in reverse: the prefix rows of dK/dV go into
the store's fp32 buffers of their slices; this slice's own rows get the buffer the later slices
filled; then the slice's cache chunk is released. A forward run inside the slice's backward
(``info.recompute``: activation recomputation) reads the same prefix and leaves the cache as it is.
"""

from __future__ import annotations

import torch

from megatron_slim.runtime.attention import AttentionBackend
from megatron_slim.runtime.pipeline.kv_cache import KVCacheStore
from megatron_slim.runtime.pipeline.slice_context import SliceInfo


def _joined(prefix: list[tuple[torch.Tensor, torch.Tensor]], k: torch.Tensor, v: torch.Tensor):
    if not prefix:
        return k, v
    return (torch.cat([k_i for k_i, _ in prefix] + [k], dim=1), torch.cat([v_i for _, v_i in prefix] + [v], dim=1))


def _keep(store: KVCacheStore, info: SliceInfo, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
    if info.recompute:
        store.check_recomputed(info.microbatch, layer, info.slice)
    else:
        store.append(info.microbatch, layer, info.slice, k, v)


class _SliceAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, q, k, v, backend: AttentionBackend, scale: float, store: KVCacheStore, info: SliceInfo, layer: int
    ):
        keys, values = _joined(store.prefix(info.microbatch, layer, info.slice), k, v)
        out, lse = backend.forward(q, keys, values, causal=True, softmax_scale=scale)
        _keep(store, info, layer, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.meta = (backend, scale, store, info, layer)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        backend, scale, store, info, layer = ctx.meta
        prefix = store.prefix(info.microbatch, layer, info.slice)
        keys, values = _joined(prefix, k, v)
        dq, dkeys, dvalues = backend.backward(
            dout.contiguous(), q, keys, values, out, lse, causal=True, softmax_scale=scale
        )
        start = 0
        for i, (k_i, _) in enumerate(prefix):
            rows = slice(start, start + k_i.shape[1])
            store.accumulate(info.microbatch, layer, i, dkeys[:, rows], dvalues[:, rows])
            start += k_i.shape[1]
        dk, dv = dkeys[:, start:], dvalues[:, start:]
        later = store.take_gradient(info.microbatch, layer, info.slice)
        if later is not None:
            dk = (dk.float() + later[0]).to(k.dtype)
            dv = (dv.float() + later[1]).to(v.dtype)
        store.release(info.microbatch, layer, info.slice)
        return dq, dk, dv, None, None, None, None, None


def sliced_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    backend: AttentionBackend,
    softmax_scale: float,
    store: KVCacheStore,
    info: SliceInfo,
    layer: int,
) -> torch.Tensor:
    """``q [b, s, hq, d]``, ``k``/``v [b, s, hkv, d]`` of slice ``info.slice`` -> ``[b, s, hq, d]``.

    K and V are made contiguous first: they stay in the cache until this slice's backward, and a
    view would keep the whole fused QKV projection output alive with them.
    """
    k, v = k.contiguous(), v.contiguous()
    if not torch.is_grad_enabled() or not (q.requires_grad or k.requires_grad or v.requires_grad):
        with torch.no_grad():
            keys, values = _joined(store.prefix(info.microbatch, layer, info.slice), k, v)
            out, _ = backend.forward(q, keys, values, causal=True, softmax_scale=softmax_scale)
            _keep(store, info, layer, k, v)
        return out
    return _SliceAttention.apply(q, k, v, backend, softmax_scale, store, info, layer)
