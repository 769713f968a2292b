"""An evaluation call (``forward_only=True``) over gloo runs the plan's validated forward-only
schedule: the losses equal a training call's on the same batches, and it leaves no gradients."""

import torch

from megatron_slim.plan.cost.slicing import uniform_slices
from megatron_slim.runtime.spawn import run_ranks
from tests.oracle.models import TINY_GQA_8L
from tests.runtime.pipeline import _workers

SEQ = TINY_GQA_8L["seq_length"]


def test_forward_only_losses_equal_the_training_losses():
    configs = [(1, 3, uniform_slices(SEQ, 2)), (2, 2, uniform_slices(SEQ, 4))]
    results = run_ranks(_workers.run_forward_only, 2, configs, timeout_s=600)
    for (evaluation, training), _ in results[-1]:  # the last stage reports the losses
        assert len(evaluation) == len(training) > 0
        for got, want in zip(evaluation, training):
            torch.testing.assert_close(got, want, atol=0, rtol=0)
    for rank in results:
        for _, (after_evaluation, after_training) in rank:
            assert after_evaluation == 0 < after_training
