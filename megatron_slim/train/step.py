"""What happens between the schedule and the optimizer: summing the gradients of tied embedding
copies, data-parallel averaging of gradients, global-norm clipping over every model-parallel rank,
and skipping a step whose gradients are not finite, so a failed step leaves model and optimizer
state as they were."""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.distributed as dist


def tied_embedding_copy(chunks) -> torch.nn.Parameter | None:
    """This rank's copy of a tied word embedding that lives on two pipeline stages: the first
    stage's input embedding, or the last stage's output weight (``None`` when the model is untied
    or one chunk holds both ends)."""
    for chunk in chunks:
        info = chunk.slim_chunk_info
        if not info.tied_embeddings or (info.pre_process and info.post_process):
            continue
        if info.pre_process:
            return chunk.embedding.word_embeddings.weight
        if info.post_process:
            return chunk.output_layer.weight
    return None


def sum_tied_embedding_grads(chunks, embedding_group) -> None:
    """Give both copies of a tied embedding the sum of their gradients (the whole model's gradient
    of the one shared weight). megatron-core does this in ``finalize_model_grads``
    (``_allreduce_word_embedding_grads``), but that helper reads ``ddp_config`` and ``main_grad``
    from DDP-wrapped chunks; this loop trains the bare chunks, so it sums ``.grad`` itself."""
    weight = tied_embedding_copy(chunks)
    if weight is None or embedding_group is None or dist.get_world_size(embedding_group) == 1:
        return
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    dist.all_reduce(weight.grad, group=embedding_group)


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
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def global_grad_norm(params: Sequence[torch.nn.Parameter], model_parallel_group, tp_rank: int) -> float:
    """L2 norm over the whole model: each pipeline rank's share, TP-replicated parameters once,
    and a tied embedding once (its last-stage copy, marked ``shared`` as megatron marks it, is left
    out, as megatron's ``param_is_not_shared`` leaves it out)."""
    total = torch.zeros((), dtype=torch.float64)
    for p in params:
        if p.grad is None or getattr(p, "shared", False):
            continue
        if not getattr(p, "tensor_model_parallel", False) and tp_rank != 0:
            continue  # replicated across TP ranks: counted on TP rank 0 only
        total += p.grad.detach().double().pow(2).sum()
    if model_parallel_group is not None:
        dist.all_reduce(total, group=model_parallel_group)
    return math.sqrt(total.item())


def loss_is_finite(reports: Sequence[dict]) -> bool:
    """Whether every rank's microbatch losses are finite (only the last pipeline stage has any):
    one all-reduce over the whole job, so every rank takes the same decision."""
    local = bool(reports) and not all(torch.isfinite(r["lm loss"]).all() for r in reports)
    bad = torch.tensor([1.0 if local else 0.0])
    if dist.is_initialized():
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return bad.item() == 0.0


def nonfinite_reason(iteration: int, loss_finite: bool, norm: float) -> str:
    what = " and ".join(
        w for w, bad in (("the loss", not loss_finite), (f"the gradient norm ({norm})", not math.isfinite(norm))) if bad
    )
    return (
        f"iteration {iteration}: {what} is not finite; training stopped before the update, so model and "
        "optimizer state are those after the previous iteration and nothing of this step was saved "
        "(Megatron's --check-for-nan-in-loss-and-grad); lower train.lr, check the data, or set "
        "train.skip_nonfinite_steps=true to skip such steps"
    )


def clip_and_step(
    params, optimizer, scheduler, clip_grad: float, model_parallel_group, tp_rank: int, loss_finite: bool = True
) -> tuple[bool, float]:
    """Returns (stepped, grad norm). A non-finite loss (see ``loss_is_finite``) or norm (identical on
    every rank after the all-reduce) leaves parameters, optimizer and scheduler untouched everywhere."""
    norm = global_grad_norm(params, model_parallel_group, tp_rank)
    if not (loss_finite and math.isfinite(norm)):
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
