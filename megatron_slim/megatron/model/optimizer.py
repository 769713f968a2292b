"""Optimizer and learning-rate schedule for CPU training on megatron-core model chunks.

megatron-core's DDP and optimizer wrappers allocate their buffers with ``device="cuda"`` (0.16.1:
``_ParamAndGradBuffer``, ``FP32Optimizer._scale``), so CPU ranks use ``torch.optim.AdamW`` with
Megatron's parameter groups (no weight decay on norms and biases) and megatron-core's own
``OptimizerParamScheduler`` (warmup, cosine decay). Gradient clipping and data-parallel averaging
live in ``megatron_slim.train.step``.
"""

from __future__ import annotations

from typing import Iterable

import torch

from megatron_slim.plan.recipe import TrainConfig


def param_groups(chunks: Iterable[torch.nn.Module], weight_decay: float) -> list[dict]:
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if not p.requires_grad:
                continue
            (no_decay if p.dim() == 1 or name.endswith(".bias") else decay).append(p)
    # megatron's scheduler reads these keys on every group
    common = {"lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False}
    return [
        dict(params=decay, weight_decay=weight_decay, wd_mult=1.0, **common),
        dict(params=no_decay, weight_decay=0.0, wd_mult=0.0, **common),
    ]


class _SchedulerTarget:
    """What ``OptimizerParamScheduler`` drives: an object with ``param_groups``. Read through on
    every access: ``optimizer.load_state_dict`` replaces the optimizer's list on resume."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = optimizer

    @property
    def param_groups(self) -> list[dict]:
        return self._optimizer.param_groups


def build_optimizer(chunks: list[torch.nn.Module], train: TrainConfig):
    """``(torch AdamW, megatron-core OptimizerParamScheduler)`` for ``train``'s schedule."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    optimizer = torch.optim.AdamW(
        param_groups(chunks, train.weight_decay),
        lr=train.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=train.weight_decay,
    )
    decay_steps = max(train.iters, train.warmup_iters + 1)
    scheduler = OptimizerParamScheduler(
        _SchedulerTarget(optimizer),
        init_lr=0.0,
        max_lr=train.lr,
        min_lr=train.min_lr,
        lr_warmup_steps=train.warmup_iters,
        lr_decay_steps=decay_steps,
        lr_decay_style="cosine",
        start_wd=train.weight_decay,
        end_wd=train.weight_decay,
        wd_incr_steps=decay_steps,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,
    )
    return optimizer, scheduler
