"""What happens between the schedule and the optimizer: data-parallel averaging of gradients,
global-norm clipping over every model-parallel rank, and skipping a step whose gradients are not
finite, so a failed step leaves model and optimizer state as they were."""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.distributed as dist


def average_data_parallel(params: Sequence[torch.nn.Parameter], dp_group, dp_size: int) -> None:
    if dp_size == 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=dp_group)
    flat /= dp_size
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def global_grad_norm(params: Sequence[torch.nn.Parameter], model_parallel_group, tp_rank: int) -> float:
    """L2 norm over the whole model: each pipeline rank's share, TP-replicated parameters once."""
    total = torch.zeros((), dtype=torch.float64)
    for p in params:
        if p.grad is None:
            continue
        if not getattr(p, "tensor_model_parallel", False) and tp_rank != 0:
            continue  # replicated across TP ranks: counted on TP rank 0 only
        total += p.grad.detach().double().pow(2).sum()
    if model_parallel_group is not None:
        dist.all_reduce(total, group=model_parallel_group)
    return math.sqrt(total.item())


def clip_and_step(params, optimizer, scheduler, clip_grad: float, model_parallel_group, tp_rank: int) -> tuple[bool, float]:
    """Returns (stepped, grad norm). A non-finite norm (identical on every rank after the
    all-reduce) skips the update everywhere."""
    norm = global_grad_norm(params, model_parallel_group, tp_rank)
    if not math.isfinite(norm):
        optimizer.zero_grad(set_to_none=True)
        return False, norm
    if clip_grad > 0 and norm > clip_grad:
        scale = clip_grad / (norm + 1e-6)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(scale)
    optimizer.step()
    scheduler.step(1)
    return True, norm
