"""Resuming with another ``train.iters`` continues with the new recipe's learning-rate schedule from
the saved step count (Megatron's ``--override-opt_param-scheduler``), instead of megatron-core's
scheduler asserting that its settings equal the checkpoint's."""

import dataclasses

import pytest
import torch

from megatron_slim.megatron.model.optimizer import build_optimizer
from megatron_slim.plan.recipe import load_recipe


def _scheduler(iters: int):
    train = dataclasses.replace(load_recipe("tiny-cpu").train, iters=iters, warmup_iters=1)
    return build_optimizer([torch.nn.Linear(4, 4)], train)


@pytest.mark.parametrize("new_iters", [4, 40])
def test_a_longer_run_resumes_on_its_own_schedule(new_iters):
    _, saved = _scheduler(2)
    saved.step(2)
    optimizer, resumed = _scheduler(new_iters)
    resumed.load_state_dict(saved.state_dict())
    fresh_optimizer, fresh = _scheduler(new_iters)
    fresh.step(2)
    assert resumed.num_steps == 2 and resumed.lr_decay_steps == fresh.lr_decay_steps
    assert optimizer.param_groups[0]["lr"] == fresh_optimizer.param_groups[0]["lr"]
