"""Query-out CP slice attention over a CP engine's placement (``plan/cp/slices.py``).

The engine planned the window once; slice ``j`` of it gives each CP rank the rows of its planned
segments inside the slice (``SliceShare``), a different count per rank (a rank without any runs
one padding row). The protocol is :mod:`cp_slice_attention`'s, with the zigzag layout replaced by
the plan's shares and the collectives padded to the largest rank:

forward
    all-gather the slice's queries (rank-major rows), attend them to this rank's keys (the slice's
    own rows and the rows it cached of the window's earlier slices) piece by piece
    (``slice_pieces``), all-to-all the partials back to the ranks holding the queries, merge by
    log-sum-exp in rank order;
backward
    all-gather (q, dout, out, lse); with the global out/lse each piece's gradient is exact on its
    own: dQ of every query, dK/dV of the cached rows into the cache store's buffers, of the own
    rows locally (plus what later slices left for them); reduce-scatter (sum) of dQ.

Keys never move, so a document the plan keeps on one rank only ever meets keys on that rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from megatron_slim.plan.cp.slices import OWN, SliceShare, slice_pieces
from megatron_slim.runtime.attention import AttentionBackend
from megatron_slim.runtime.pipeline.cp_collectives import all_gather, combine_partials, reduce_scatter_sum
from megatron_slim.runtime.pipeline.cp_document_attention import pieces_forward
from megatron_slim.runtime.pipeline.cp_slice_attention import CachedSlice, backward_over_cache
from megatron_slim.runtime.pipeline.kv_cache import KVCacheStore
from megatron_slim.runtime.pipeline.slice_context import SliceInfo

Tensor = torch.Tensor


@dataclass(frozen=True)
class _Setup:
    backend: AttentionBackend
    scale: float
    group: object
    rank: int
    shares: tuple[SliceShare, ...]
    index: int  # the slice
    documents: tuple[int, ...]

    @property
    def share(self) -> SliceShare:
        return self.shares[self.index]

    @property
    def counts(self) -> list[int]:
        return [self.share.rows(r) for r in range(len(self.share.runs))]

    def pieces(self) -> list:
        return slice_pieces(self.shares, self.index, self.rank, self.documents)


def _padded(x: Tensor, rows: int, dim: int) -> Tensor:
    """``x`` with zero rows appended along ``dim`` up to ``rows``."""
    missing = rows - x.shape[dim]
    if missing == 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x, torch.zeros(shape, dtype=x.dtype, device=x.device)], dim)


def _gather_rows(s: _Setup, tensors: Sequence[Tensor], dims: Sequence[int]) -> list[Tensor]:
    """Every rank's rows of each tensor (rows along its ``dim``), concatenated rank-major."""
    counts = s.counts
    most = max(counts)
    gathered = all_gather([_padded(t, most, d) for t, d in zip(tensors, dims)], s.group)
    return [torch.cat([g[r].narrow(d, 0, n) for r, n in enumerate(counts)], d) for g, d in zip(gathered, dims)]


def _to_ranks(s: _Setup, x: Tensor, dim: int) -> Tensor:
    """Rank-major rows of ``x`` -> ``[cp, *x.shape]`` with rank ``r``'s rows first, zero-padded to the largest."""
    counts, offsets = s.counts, s.share.row_offsets()
    most = max(counts)
    return torch.stack([_padded(x.narrow(dim, o, n), most, dim) for o, n in zip(offsets, counts)])


def _forward(s: _Setup, q: Tensor, k: Tensor, v: Tensor, prefix: list) -> tuple[Tensor, Tensor]:
    (q_all,) = _gather_rows(s, [q], [1])
    b, length, hq, _ = q_all.shape
    out = torch.zeros((b, length, hq, v.shape[-1]), dtype=torch.float32, device=q.device)
    lse = torch.full((b, hq, length), float("-inf"), dtype=torch.float32, device=q.device)
    pieces_forward(s.backend, s.scale, q_all, {OWN: (k, v), **dict(enumerate(prefix))}, s.pieces(), out, lse)
    acc_out, acc_lse = combine_partials(_to_ranks(s, out, 1), _to_ranks(s, lse, 2), s.group, rows=q.shape[1])
    return acc_out.to(q.dtype), acc_lse


def _backward(s: _Setup, dout: Tensor, saved: tuple, cached: CachedSlice) -> tuple[Tensor, Tensor, Tensor]:
    q, k, v, out, lse = saved
    qp, doutp, outp, lsep = _gather_rows(s, [q, dout, out, lse], [1, 1, 1, 2])
    pieces = lambda prefix: s.pieces()  # noqa: E731 (the plan's pieces already name the cached slices)
    dq, dk, dv = backward_over_cache(s.backend, s.scale, qp, doutp, outp, lsep, k, v, cached, pieces)
    dq_mine = reduce_scatter_sum(_to_ranks(s, dq, 1), s.group).narrow(1, 0, q.shape[1])
    return dq_mine.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _PlannedSliceAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, setup: _Setup, cached: CachedSlice):
        out, lse = _forward(setup, q, k, v, cached.prefix())
        cached.append(k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.meta = (setup, cached)
        return out

    @staticmethod
    def backward(ctx, dout):
        setup, cached = ctx.meta
        dq, dk, dv = _backward(setup, dout.contiguous(), ctx.saved_tensors, cached)
        return dq, dk, dv, None, None


def planned_slice_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    backend: AttentionBackend,
    softmax_scale: float,
    group,
    store: KVCacheStore,
    info: SliceInfo,
    layer: int,
    documents: tuple[int, ...],
    shares: tuple[SliceShare, ...],
) -> Tensor:
    """This CP rank's rows of slice ``info.slice`` of a planned window: ``q [1, n, hq, d]``,
    ``k``/``v [1, n, hkv, d]`` with ``n = shares[info.slice].rows(rank)`` -> ``[1, n, hq, d]``,
    attending inside each of the window's ``documents`` to the slice and to the earlier slices
    cached in ``store``."""
    rank = dist.get_rank(group)
    share = shares[info.slice]
    if q.shape[0] != 1 or q.shape[1] != share.rows(rank) or share.length != info.length:
        raise ValueError(
            f"slice {info.slice} of microbatch {info.microbatch}: CP rank {rank} got q of shape {tuple(q.shape)} "
            f"for a {info.length}-token slice; allowed: [1, {share.rows(rank)}, ...], the rows the CP plan "
            f"gives it of the {share.length}-token slice"
        )
    setup = _Setup(backend, softmax_scale, group, rank, tuple(shares), info.slice, tuple(documents))
    cached = CachedSlice(store, info.microbatch, info.slice, layer, info.recompute)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if not torch.is_grad_enabled() or not (q.requires_grad or k.requires_grad or v.requires_grad):
        with torch.no_grad():
            out, _ = _forward(setup, q, k, v, cached.prefix())
            cached.append(k, v)
        return out
    return _PlannedSliceAttention.apply(q, k, v, setup, cached)
