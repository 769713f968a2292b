"""Slice attention under context parallelism: "query-out" (SlimPipe section 6).

Every slice is split zigzag-wise over the CP ranks (:mod:`zigzag`); each rank caches only *its*
K/V shards of the earlier slices. The K/V prefix of a late slice is far larger than the slice's
queries, so queries move, keys never do:

forward of slice j
    1. all-gather Q of the slice (``[cp, b, s/cp, hq, d]``: one slice of queries);
    2. every rank attends ALL the slice's queries to its local keys: its shards of slices < j fully,
       its two chunks of slice j block-causally by chunk position (same chunk: causal square;
       earlier query chunk: nothing; later: full); partials merge by log-sum-exp in fp32;
    3. all-to-all of the partials (out fp32 + lse, rank-major): rank i receives every rank's
       partial of *its* rows and merges them by log-sum-exp in rank order.
    An all-to-all rather than a reduce-scatter: the combination is a log-sum-exp merge, not a sum;
    a reduce-scatter would first need the global lse (one more, latency-bound collective) to
    rescale. Both move the same bytes.

backward of slice j (slices run in reverse)
    1. all-gather (q, dout, out, lse) of the slice's queries, one collective;
    2. with the *global* out/lse each local block's gradient is exact on its own: dQ of all the
       slice's queries against local keys (fp32), dK/dV of the prefix shards into the cache store's
       fp32 buffers (as without CP), dK/dV of the rank's own two chunks locally, plus what later
       slices left in the store for them;
    3. reduce-scatter (sum) of dQ in fp32: each rank gets the sum over ranks of its queries' dQ.

Memory per rank: K/V cache and dK/dV buffers are 1/cp of the unsharded ones; transient buffers are
one slice's queries, out and lse for all cp ranks (no K/V is ever gathered). Every CP rank of a
pipeline stage runs the same schedule, so the collectives of (microbatch, slice, layer) line up.
Context exchange: a sender's blocks of its cached rows are attended on their taker stages (``cp_exchange``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megatron_slim.runtime.attention import AttentionBackend, merge_
from megatron_slim.runtime.pipeline.context_exchange import ContextExchange
from megatron_slim.runtime.pipeline.cp_collectives import all_gather, combine_partials, reduce_scatter_sum
from megatron_slim.runtime.pipeline.cp_document_attention import (
    OWN,
    document_pieces,
    pieces_backward,
    pieces_forward,
)
from megatron_slim.runtime.pipeline.cp_exchange import open_backward, open_forward
from megatron_slim.runtime.pipeline.kv_cache import KVCacheStore
from megatron_slim.runtime.pipeline.slice_context import SliceInfo
from megatron_slim.runtime.pipeline.zigzag import ZigzagLayout

Tensor = torch.Tensor


@dataclass(frozen=True)
class CachedSlice:
    """The cache entries of one (microbatch, slice, layer); ``store`` None: one uncached sequence."""

    store: Optional[KVCacheStore]
    microbatch: int = 0
    slice: int = 0
    layer: int = 0
    recompute: bool = False  # a forward inside the slice's backward: its K/V are cached already

    def prefix(self) -> list[tuple[Tensor, Tensor]]:
        return self.store.prefix(self.microbatch, self.layer, self.slice) if self.store is not None else []

    def append(self, k: Tensor, v: Tensor) -> None:
        if self.store is not None and self.recompute:
            self.store.check_recomputed(self.microbatch, self.layer, self.slice)
        elif self.store is not None:
            self.store.append(self.microbatch, self.layer, self.slice, k, v)

    def accumulate(self, i: int, dk: Tensor, dv: Tensor) -> None:
        assert self.store is not None  # backward of a slice that kept its K/V
        self.store.accumulate(self.microbatch, self.layer, i, dk, dv)

    def take_gradient(self):
        return self.store.take_gradient(self.microbatch, self.layer, self.slice) if self.store is not None else None

    def release(self) -> None:
        if self.store is not None:
            self.store.release(self.microbatch, self.layer, self.slice)


@dataclass(frozen=True)
class _Setup:
    backend: AttentionBackend
    scale: float
    group: object
    rank: int
    layout: ZigzagLayout
    documents: Optional[tuple[int, ...]] = None  # a packed window's documents (cp_document_attention)
    start: int = 0  # the slice's first position in its window
    exchange: Optional[ContextExchange] = None  # context exchange (``cp_exchange``), unpacked windows only

    def pieces(self, prefix: list) -> list:
        lengths = [k_i.shape[1] * self.layout.cp for k_i, _ in prefix]
        assert self.documents is not None
        return document_pieces(self.layout, self.rank, self.start, lengths, self.documents)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _from_ranks(gathered: Tensor, layout: ZigzagLayout, seq_dim: int) -> Tensor:
    """``[cp, *local]`` (local sequence at ``seq_dim``) -> one tensor in position order."""
    x = gathered.movedim(0, seq_dim).flatten(seq_dim, seq_dim + 1)
    return layout.to_positions(x, seq_dim)


def _to_ranks(x: Tensor, layout: ZigzagLayout, seq_dim: int) -> Tensor:
    """Inverse of :func:`_from_ranks`: ``[cp, *local]``, entry ``i`` holding rank ``i``'s rows."""
    x = layout.to_rank_major(x, seq_dim).unflatten(seq_dim, (layout.cp, 2 * layout.chunk))
    return x.movedim(seq_dim, 0)


def _rows(x: Tensor, first: int, n: int, dim: int = 1) -> Tensor:
    return x.narrow(dim, first, n)


def _partial_forward(s: _Setup, q: Tensor, k: Tensor, v: Tensor, prefix) -> tuple[Tensor, Tensor]:
    """All the slice's queries (position order) against this rank's keys -> (out, lse) partials."""
    b, length, hq, _ = q.shape
    out = torch.zeros((b, length, hq, v.shape[-1]), dtype=_acc_dtype(q.dtype), device=q.device)
    lse = torch.full((b, hq, length), float("-inf"), dtype=torch.float32, device=q.device)
    if s.documents is not None:
        keys = {OWN: (k, v), **dict(enumerate(prefix))}
        pieces_forward(s.backend, s.scale, q, keys, s.pieces(prefix), out, lse)
        return out, lse
    for k_i, v_i in prefix:
        merge_(out, lse, *s.backend.forward(q, k_i, v_i, causal=False, softmax_scale=s.scale))
    c = s.layout.chunk
    for t, first, n, causal in s.layout.key_blocks(s.rank):
        o, o_lse = s.backend.forward(
            _rows(q, first, n).contiguous(),
            _rows(k, t * c, c).contiguous(),
            _rows(v, t * c, c).contiguous(),
            causal=causal,
            softmax_scale=s.scale,
        )
        merge_(_rows(out, first, n), _rows(lse, first, n, dim=2), o, o_lse)
    return out, lse


def _combine(s: _Setup, out: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
    """Partials of every rank for every query -> this rank's rows, merged (all-to-all + lse merge)."""
    return combine_partials(_to_ranks(out, s.layout, 1), _to_ranks(lse, s.layout, 2), s.group)


def _forward(s: _Setup, q: Tensor, k: Tensor, v: Tensor, cached: CachedSlice) -> tuple[Tensor, Tensor]:
    opened = open_forward(s.exchange, s, q, cached.prefix(), cached.recompute)  # a sender ships its blocks' rows
    q_all = _from_ranks(all_gather([q], s.group)[0], s.layout, 1)
    out, lse = _partial_forward(s, q_all, k, v, [(k_i, v_i) for _, k_i, v_i in opened.kept()])
    out, lse = _combine(s, out, lse)
    opened.close_forward(out, lse)
    return out.to(q.dtype), lse


def _backward(
    s: _Setup, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cached: CachedSlice
) -> tuple[Tensor, Tensor, Tensor]:
    opened = open_backward(s.exchange, s, dout, q, out, lse, cached.prefix())
    q_all, dout_all, out_all, lse_all = all_gather([q, dout, out, lse], s.group)
    qp, doutp, outp = (_from_ranks(t, s.layout, 1) for t in (q_all, dout_all, out_all))
    lsep = _from_ranks(lse_all, s.layout, 2)
    if s.documents is not None:
        return _document_backward(s, qp, doutp, outp, lsep, k, v, cached)
    acc = _acc_dtype(q.dtype)
    dq = torch.zeros(qp.shape, dtype=acc, device=q.device)
    for i, k_i, v_i in opened.kept():
        dq_i, dk_i, dv_i = s.backend.backward(doutp, qp, k_i, v_i, outp, lsep, causal=False, softmax_scale=s.scale)
        dq += dq_i
        opened.accumulate(i, dk_i, dv_i, cached.accumulate)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    c = s.layout.chunk
    for t, first, n, causal in s.layout.key_blocks(s.rank):
        rows = [_rows(x, first, n).contiguous() for x in (doutp, qp)]
        dq_b, dk_b, dv_b = s.backend.backward(
            rows[0],
            rows[1],
            _rows(k, t * c, c).contiguous(),
            _rows(v, t * c, c).contiguous(),
            _rows(outp, first, n).contiguous(),
            _rows(lsep, first, n, dim=2).contiguous(),
            causal=causal,
            softmax_scale=s.scale,
        )
        _rows(dq, first, n).add_(dq_b)
        _rows(dk, t * c, c).add_(dk_b)
        _rows(dv, t * c, c).add_(dv_b)
    dq_moved = opened.close_backward(cached.accumulate)
    later = cached.take_gradient()
    if later is not None:
        dk += later[0]
        dv += later[1]
    cached.release()
    dq_mine = reduce_scatter_sum(_to_ranks(dq, s.layout, 1), s.group) + dq_moved
    return dq_mine.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def backward_over_cache(backend: AttentionBackend, scale: float, q, dout, out, lse, k, v, cached, pieces_for):
    """The pieces' backward over this slice's keys (``OWN``) and the cached slices' (``pieces_for(prefix)``
    lists the pieces): the cached slices' dK/dV go into their accumulators, this slice's include what
    later slices accumulated into it. Returns (dq of the gathered queries, dk, dv)."""
    prefix = cached.prefix()
    keys = {OWN: (k, v), **dict(enumerate(prefix))}
    dq, grads = pieces_backward(backend, scale, q, dout, out, lse, keys, pieces_for(prefix))
    for i in range(len(prefix)):
        cached.accumulate(i, *grads[i])
    dk, dv = grads[OWN]
    later = cached.take_gradient()
    if later is not None:
        dk, dv = dk + later[0], dv + later[1]
    cached.release()
    return dq, dk, dv


def _document_backward(s: _Setup, qp, doutp, outp, lsep, k: Tensor, v: Tensor, cached: CachedSlice):
    dq, dk, dv = backward_over_cache(s.backend, s.scale, qp, doutp, outp, lsep, k, v, cached, s.pieces)
    dq_mine = reduce_scatter_sum(_to_ranks(dq, s.layout, 1), s.group)
    return dq_mine.to(qp.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _CPSliceAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, setup: _Setup, cached: CachedSlice):
        out, lse = _forward(setup, q, k, v, cached)
        cached.append(k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.meta = (setup, cached)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        setup, cached = ctx.meta
        dq, dk, dv = _backward(setup, dout.contiguous(), q, k, v, out, lse, cached)
        return dq, dk, dv, None, None


def cp_sliced_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    backend: AttentionBackend,
    softmax_scale: float,
    group,
    store: Optional[KVCacheStore] = None,
    info: Optional[SliceInfo] = None,
    layer: int = 0,
    documents: Optional[tuple[int, ...]] = None,
    exchange: Optional[ContextExchange] = None,
) -> Tensor:
    """This CP rank's zigzag shard of one slice: ``q [b, s/cp, hq, d]``, ``k``/``v [b, s/cp, hkv, d]``
    -> ``[b, s/cp, hq, d]``, attending causally to the whole slice and to the earlier slices cached in
    ``store`` (this rank's shards). ``store``/``info`` None: the local tokens are the zigzag shard of
    one whole, uncached sequence. ``documents``: the window's document lengths (``b = 1``; attention
    stays inside each document), with ``info``. ``exchange``: the run's context exchange (``cp_exchange``).
    """
    cp = dist.get_world_size(group)
    local = q.shape[1]
    length = local * cp
    if info is not None and info.length != length:
        raise ValueError(
            f"slice {info.slice} of microbatch {info.microbatch}: {local} local tokens x cp={cp} "
            f"= {length}, but the slice plan says {info.length} tokens"
        )
    if (store is None) != (info is None):
        raise ValueError("store and info: pass both (a cached slice) or neither (one whole sequence)")
    if documents is not None and (info is None or q.shape[0] != 1):
        raise ValueError("documents: allowed only for a cached slice (info) of micro-batch size 1")
    start = info.start if info is not None else 0
    layout, exchange = ZigzagLayout(cp, length), exchange if info is not None else None
    setup = _Setup(backend, softmax_scale, group, dist.get_rank(group), layout, documents, start, exchange)
    cached = (
        CachedSlice(store) if info is None else CachedSlice(store, info.microbatch, info.slice, layer, info.recompute)
    )
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if not torch.is_grad_enabled() or not (q.requires_grad or k.requires_grad or v.requires_grad):
        with torch.no_grad():
            out, _ = _forward(setup, q, k, v, cached)
            cached.append(k, v)
        return out
    return _CPSliceAttention.apply(q, k, v, setup, cached)
