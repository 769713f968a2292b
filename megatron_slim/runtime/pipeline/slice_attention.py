"""Causal attention of one slice against the K/V cache of the earlier slices.

The slice's queries are the last ``s`` positions of the keys ``[prefix; own]``, which is exactly
the kernel library's bottom-right causal mask: one kernel call over the cached chunks joined with
the slice's own K/V, forward and backward. (One large call beats one call per cached chunk by a
wide margin, and the join is a transient copy of the prefix that the kernel reads anyway.) The
cache itself stays per slice. Backward runs slices in reverse: the prefix rows of dK/dV go into
the store's fp32 buffers of their slices; this slice's own rows get the buffer the later slices
filled; then the slice's cache chunk is released. A forward run inside the slice's backward
(``info.recompute``: activation recomputation) reads the same prefix and leaves the cache as it is.

A packed window (``documents``: a :class:`SliceDocuments`) reads keys only from the start of the
document holding the slice's first token, and attends through the backends' varlen kernels, one
sequence per document touched (bottom-right causal per document: its queries are the last of its
keys). Cached chunks wholly before that start get no dK/dV from this slice; the chunk holding it
gets zeros for its rows before it.

Context exchange (``exchange``, ``runtime/pipeline/context_exchange.py``): a sender's blocks of its
K/V prefix go to their takers; its own call covers the rest and merges the blocks by log-sum-exp,
and their dK/dV go into the cached slices' accumulators at their rows (``exchange_sender.py``). A
taker's blocks are served beside its own layers (``exchange_server.py``); its own attention is plain.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_slim.runtime.attention import AttentionBackend
from megatron_slim.runtime.pipeline.context_exchange import ContextExchange, ExchangeRole, paired_role
from megatron_slim.runtime.pipeline.documents import SliceDocuments
from megatron_slim.runtime.pipeline.dp_merge import MergeLink
from megatron_slim.runtime.pipeline.exchange_sender import sender_backward, sender_forward
from megatron_slim.runtime.pipeline.kv_cache import KVCacheStore
from megatron_slim.runtime.pipeline.slice_context import SliceInfo


@dataclass(frozen=True)
class _Keys:
    """Which cached chunks a slice reads: chunks ``first ..`` joined, minus ``skip`` leading rows."""

    first: int
    skip: int


def _keys_of(prefix: list, documents: Optional[SliceDocuments]) -> _Keys:
    if documents is None:
        return _Keys(0, 0)
    chunk_start = 0
    for i, (k_i, _) in enumerate(prefix):
        if documents.key_start < chunk_start + k_i.shape[1]:
            return _Keys(i, documents.key_start - chunk_start)
        chunk_start += k_i.shape[1]
    return _Keys(len(prefix), documents.key_start - chunk_start)


def _joined(prefix: list, k: torch.Tensor, v: torch.Tensor, keys: _Keys):
    chunks = prefix[keys.first :]
    if chunks:
        k = torch.cat([k_i for k_i, _ in chunks] + [k], dim=1)
        v = torch.cat([v_i for _, v_i in chunks] + [v], dim=1)
    return k[:, keys.skip :], v[:, keys.skip :]


def _forward(backend: AttentionBackend, q, keys, values, scale: float, documents: Optional[SliceDocuments]):
    if documents is None:
        return backend.forward(q, keys, values, causal=True, softmax_scale=scale)
    cu_q, cu_k = documents.cu_seqlens(q.device)
    out, lse = backend.varlen_forward(
        q[0],
        keys[0],
        values[0],
        cu_q,
        cu_k,
        max(documents.q_lengths),
        max(documents.k_lengths),
        causal=True,
        softmax_scale=scale,
    )
    return out.unsqueeze(0), lse


def _backward(backend: AttentionBackend, dout, q, keys, values, out, lse, scale: float, documents):
    if documents is None:
        return backend.backward(dout, q, keys, values, out, lse, causal=True, softmax_scale=scale)
    cu_q, cu_k = documents.cu_seqlens(q.device)
    dq, dk, dv = backend.varlen_backward(
        dout[0],
        q[0],
        keys[0],
        values[0],
        out[0],
        lse,
        cu_q,
        cu_k,
        max(documents.q_lengths),
        max(documents.k_lengths),
        causal=True,
        softmax_scale=scale,
    )
    return dq.unsqueeze(0), dk.unsqueeze(0), dv.unsqueeze(0)


def _keep(store: KVCacheStore, info: SliceInfo, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
    if info.recompute:
        store.check_recomputed(info.microbatch, layer, info.slice)
    else:
        store.append(info.microbatch, layer, info.slice, k, v)


def _with_skipped_rows(d: torch.Tensor, skip: int) -> torch.Tensor:
    """Zero gradient rows for the first chunk's keys before the slice's first document."""
    return torch.cat([d.new_zeros(d.shape[0], skip, *d.shape[2:]), d], dim=1) if skip else d


def _role(exchange: Optional[ContextExchange], info: SliceInfo, documents, backward=False) -> Optional[ExchangeRole]:
    """A backward pairs whatever built its graph (a recomputed forward included)."""
    return paired_role(exchange, documents is not None, info.recompute and not backward)


def _attend(
    backend, q, k, v, scale: float, store: KVCacheStore, info: SliceInfo, layer: int, documents, exchange, dp_merge=None
):
    """(out, lse) of the slice; an exchange sender's blocks are attended to by their takers and merge
    with the sender's own causal attention over the rest (module docstring); ``dp_merge``:
    DP-merge heads sent, tails' foreign K/V joined (``dp_merge.MergeLink``)."""
    prefix = store.prefix(info.microbatch, layer, info.slice)
    if dp_merge is not None:
        dp_merge.send_heads(info, layer, prefix, k, v)
    role = _role(exchange, info, documents)
    if role is not None and role.sender:
        return sender_forward(backend, q, k, v, scale, prefix, exchange)
    keys, values = _joined(prefix, k, v, _keys_of(prefix, documents))
    if dp_merge is not None:
        keys, values, documents, _ = dp_merge.join_foreign(info, layer, keys, values, documents)
    return _forward(backend, q, keys, values, scale, documents)


def _local_backward(backend, dout, q, k, v, out, lse, scale, prefix, span: _Keys, documents, dp_merge, info, layer):
    """Gradients of the slice's attention over ``span`` of its prefix (packed documents and DP-merge
    foreign keys included): (dQ, the prefix chunks' dK/dV from ``span.first`` on, the slice's own dK/dV)."""
    keys, values = _joined(prefix, k, v, span)
    spots: list = []
    if dp_merge is not None:
        keys, values, documents, spots = dp_merge.join_foreign(info, layer, keys, values, documents)
    dq, dkeys, dvalues = _backward(backend, dout, q, keys, values, out, lse, scale, documents)
    if spots:
        dkeys, dvalues = dp_merge.strip_foreign(info, layer, dkeys, dvalues, spots)
    dkeys, dvalues = _with_skipped_rows(dkeys, span.skip), _with_skipped_rows(dvalues, span.skip)
    kept = dkeys.shape[1] - k.shape[1]
    return dq, dkeys[:, :kept], dvalues[:, :kept], dkeys[:, kept:], dvalues[:, kept:]


def _accumulate_prefix(store: KVCacheStore, info: SliceInfo, layer: int, prefix: list, first: int, dk, dv) -> None:
    """Rows of ``dk``/``dv`` into the accumulators of cached chunks ``first ..``, in order."""
    start = 0
    for i in range(first, len(prefix)):
        rows = slice(start, start + prefix[i][0].shape[1])
        store.accumulate(info.microbatch, layer, i, dk[:, rows], dv[:, rows])
        start = rows.stop


class _SliceAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        q,
        k,
        v,
        backend: AttentionBackend,
        scale: float,
        store: KVCacheStore,
        info: SliceInfo,
        layer: int,
        documents: Optional[SliceDocuments],
        exchange: Optional[ContextExchange],
        dp_merge: Optional[MergeLink],
    ):
        out, lse = _attend(backend, q, k, v, scale, store, info, layer, documents, exchange, dp_merge)
        _keep(store, info, layer, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.meta = (backend, scale, store, info, layer, documents, exchange, dp_merge)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        backend, scale, store, info, layer, documents, exchange, dp_merge = ctx.meta
        prefix = store.prefix(info.microbatch, layer, info.slice)
        dout = dout.contiguous()
        role = _role(exchange, info, documents, backward=True)
        if role is not None and role.sender:
            first, grads = 0, sender_backward(backend, dout, q, k, v, out, lse, scale, prefix, exchange)
        else:
            span = _keys_of(prefix, documents)
            meta = (scale, prefix, span, documents, dp_merge, info, layer)
            first, grads = span.first, _local_backward(backend, dout, q, k, v, out, lse, *meta)
        dq, dk_prefix, dv_prefix, dk, dv = grads
        _accumulate_prefix(store, info, layer, prefix, first, dk_prefix, dv_prefix)
        if dp_merge is not None:
            dk, dv = dp_merge.add_head_grads(info, layer, store, prefix, dk, dv)
        later = store.take_gradient(info.microbatch, layer, info.slice)
        if later is not None:
            dk = (dk.float() + later[0]).to(k.dtype)
            dv = (dv.float() + later[1]).to(v.dtype)
        store.release(info.microbatch, layer, info.slice)
        return dq, dk, dv, None, None, None, None, None, None, None, None


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
    documents: Optional[SliceDocuments] = None,
    exchange: Optional[ContextExchange] = None,
    dp_merge: Optional[MergeLink] = None,
) -> torch.Tensor:
    """``q [b, s, hq, d]``, ``k``/``v [b, s, hkv, d]`` of slice ``info.slice`` -> ``[b, s, hq, d]``;
    ``documents``: the slice of a packed ``b = 1`` window (attention stays inside each document);
    ``exchange``: the run's context exchange (``runtime/pipeline/context_exchange.py``), if any;
    ``dp_merge``: the iteration's DP-merge transfers on this rank (``runtime/pipeline/dp_merge.py``), if any.

    K and V are made contiguous first: they stay in the cache until this slice's backward, and a
    view would keep the whole fused QKV projection output alive with them.
    """
    k, v = k.contiguous(), v.contiguous()
    if exchange is not None:
        exchange.backend = backend  # what this rank's exchange server computes blocks with
    if not torch.is_grad_enabled() or not (q.requires_grad or k.requires_grad or v.requires_grad):
        with torch.no_grad():
            out, _ = _attend(backend, q, k, v, softmax_scale, store, info, layer, documents, exchange, dp_merge)
            _keep(store, info, layer, k, v)
        if torch.is_grad_enabled() and info.is_last and not (info.forward_only or info.recompute):
            store.drop_layer(info.microbatch, layer)  # training, but no backward will release it
        return out
    return _SliceAttention.apply(q, k, v, backend, softmax_scale, store, info, layer, documents, exchange, dp_merge)
