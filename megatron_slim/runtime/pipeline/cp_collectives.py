"""The three collectives of query-out context parallelism, on an injected CP process group, and the
all-to-all + log-sum-exp merge that gives each rank its rows' combined attention partials.

All tensors are exchanged *rank-major*: a leading dimension of size ``cp`` whose entry ``i`` is
CP rank ``i``'s part (rank ``i`` = the group's ``i``-th rank, megatron's CP rank). Backend-neutral
(gloo on CPU, NCCL on GPU): no device is assumed, no group is created.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_slim.runtime.attention import merge_

Tensor = torch.Tensor

# torch 2.12+ renamed the single-tensor collectives; same semantics, the old names warn.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather(tensors: Sequence[Tensor], group) -> list[Tensor]:
    """Every rank's ``tensors`` as ``[cp, *shape]`` each, in one collective.

    Tensors of different dtypes travel as one byte buffer; every rank must pass the same shapes
    and dtypes.
    """
    cp = dist.get_world_size(group)
    flat = [t.detach().contiguous().reshape(-1) for t in tensors]
    if len({t.dtype for t in flat}) == 1:
        packed, unit = torch.cat(flat), None
    else:
        packed, unit = torch.cat([t.view(torch.uint8) for t in flat]), torch.uint8
    out = torch.empty((cp, packed.numel()), dtype=packed.dtype, device=packed.device)
    _all_gather_single(out.view(-1), packed, group=group)
    parts, offset = [], 0
    for t, src in zip(flat, tensors):
        size = t.numel() * (t.element_size() if unit is not None else 1)
        piece = out[:, offset : offset + size]
        if unit is not None:
            piece = piece.contiguous().view(t.dtype)
        parts.append(piece.reshape(cp, *src.shape))
        offset += size
    return parts


def all_to_all(send: Tensor, group) -> Tensor:
    """``send[i]`` goes to rank ``i``; returns ``recv`` with ``recv[i]`` from rank ``i``."""
    send = send.contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv


def reduce_scatter_sum(x: Tensor, group) -> Tensor:
    """``sum over ranks of x[me]``: ``x`` is ``[cp, ...]``, the result ``x.shape[1:]``."""
    x = x.contiguous()
    out = torch.empty(x.shape[1:], dtype=x.dtype, device=x.device)
    _reduce_scatter_single(out.view(-1), x.view(-1), group=group)
    return out


def merge_ranks(outs: Tensor, lses: Tensor) -> tuple[Tensor, Tensor]:
    """Every rank's partial of one rank's rows (``[cp, ...]``) merged by log-sum-exp in rank order."""
    acc_out, acc_lse = outs[0].clone(), lses[0].clone()
    for i in range(1, outs.shape[0]):
        merge_(acc_out, acc_lse, outs[i], lses[i])
    return acc_out, acc_lse


def combine_partials(out_r: Tensor, lse_r: Tensor, group, rows: Optional[int] = None) -> tuple[Tensor, Tensor]:
    """Partial attention of every rank's query rows, rank-major (``out_r`` ``[cp, b, rows, h, d]``,
    ``lse_r`` ``[cp, b, h, rows]``) -> this rank's rows, merged over the partials every rank computed
    (one all-to-all, then log-sum-exp in rank order). ``rows``: keep only the first ``rows`` (padding
    dropped). The lse travels in ``out_r``'s dtype and comes back as float32."""
    cp = out_r.shape[0]
    recv = all_to_all(torch.cat([out_r.reshape(cp, -1), lse_r.to(out_r.dtype).reshape(cp, -1)], dim=1), group)
    n = out_r[0].numel()
    outs, lses = recv[:, :n].reshape(out_r.shape), recv[:, n:].reshape(lse_r.shape).float()
    if rows is not None:
        outs, lses = outs.narrow(2, 0, rows), lses.narrow(3, 0, rows)
    return merge_ranks(outs, lses)
