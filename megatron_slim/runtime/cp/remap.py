"""Move rows between the attention layout and the token-balanced layout, as a ``RemapPlan`` says.

Rank ``r`` keeps its rows ``[0, keep[r])`` in place; every transfer ``(src, [a, b)) -> (dst,
[c, d))`` moves a run of rows. All transfers of a step form one all-to-all over the CP group
(``all_to_all_single`` with the plan's ``send_counts`` as split sizes: gloo and NCCL both have it,
uneven splits included); a rank's chunk for ``dst`` is its runs for ``dst`` in plan order, and the
receiver cuts its chunk from ``src`` the same way. The move is a permutation of the pack's tokens,
so its backward is the inverse plan's move of the gradient. Steps where nothing moves skip the
collective on every rank (all ranks read the same plan).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron_slim.plan.cp.remap import RemapPlan
from megatron_slim.runtime.cp.comm import Comm
from megatron_slim.runtime.cp.run_context import flat2d

Tensor = torch.Tensor


def move_rows(x: Tensor, plan: RemapPlan, comm: Comm) -> Tensor:
    """``x`` ``[source_tokens[me], ...]`` -> ``[target_tokens[me], ...]`` (no autograd)."""
    me = comm.me
    if plan.num_ranks != comm.size:
        raise ValueError(f"remap plan for {plan.num_ranks} ranks, but the CP group has {comm.size}")
    if x.shape[0] != plan.source_tokens[me]:
        raise ValueError(f"remap: CP rank {me} holds {x.shape[0]} rows, the plan expects {plan.source_tokens[me]}")
    flat = flat2d(x)
    out = flat.new_empty(plan.target_tokens[me], flat.shape[1])
    keep = plan.keep[me]
    out[:keep] = flat[:keep]
    if plan.moved_tokens == 0:
        return out.view(plan.target_tokens[me], *x.shape[1:])
    outgoing = [t for t in plan.transfers if t.src == me]
    incoming = [t for t in plan.transfers if t.dst == me]
    send = (
        torch.cat([flat[t.src_start : t.src_end] for t in sorted(outgoing, key=lambda t: t.dst)])
        if outgoing
        else flat.new_empty(0, flat.shape[1])
    )
    counts = plan.send_counts()
    received = flat.new_empty(sum(counts[s][me] for s in range(comm.size)), flat.shape[1])
    dist.all_to_all_single(
        received, send.contiguous(), [counts[s][me] for s in range(comm.size)], list(counts[me]), group=comm.group
    )
    row = 0
    for t in sorted(incoming, key=lambda t: t.src):  # stable: plan order within one source
        out[t.dst_start : t.dst_end] = received[row : row + t.tokens]
        row += t.tokens
    return out.view(plan.target_tokens[me], *x.shape[1:])


class _RemapRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, plan: RemapPlan, back: RemapPlan, comm: Comm):
        ctx.back, ctx.comm = back, comm
        return move_rows(x, plan, comm)

    @staticmethod
    def backward(ctx, grad):
        return move_rows(grad.contiguous(), ctx.back, ctx.comm), None, None, None


def remap_rows(x: Tensor, plan: RemapPlan, comm: Comm, back: Optional[RemapPlan] = None) -> Tensor:
    """Differentiable move of ``x``'s rows (dim 0) by ``plan``; ``back`` (default ``plan.inverse()``)
    is the plan its gradient moves by."""
    return _RemapRows.apply(x, plan, back if back is not None else plan.inverse(), comm)
