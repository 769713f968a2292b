"""An evaluation step runs the plan's forward-only schedule: forwards only, no graph kept, nothing left."""

import torch

from megatron_slim.plan.schedule.executable import executable, executable_forward_only
from megatron_slim.runtime.pipeline.interpreter import PipelineInterpreter, StageOps
from megatron_slim.runtime.pipeline.kv_cache import KVCacheStore
from megatron_slim.runtime.pipeline.loss import SlicedLoss
from megatron_slim.runtime.pipeline.slice_context import SliceContext


def test_a_forward_only_schedule_runs_forwards_without_a_graph():
    schedule = executable_forward_only(executable("slimpipe", 1, 2, 3, 2))  # one rank, two chunks
    weight = torch.ones(2, requires_grad=True)
    calls = []

    def forward(chunk, inp):
        calls.append((chunk, inp is None))
        x = torch.ones(2, 1, 4) if inp is None else inp
        out = x * weight[chunk]
        return out, lambda o: (o.sum(), torch.tensor(o.numel()), {"lm loss": o.sum().detach()})

    def backward(inp, out, grad):
        raise AssertionError("no backward in a forward-only schedule")

    ops = StageOps(forward=forward, backward=backward, tensor_shape=lambda mb, j: (2, 1, 4), dtype=torch.float32)
    stores = [KVCacheStore() for _ in range(schedule.vpp)]
    loss = SlicedLoss(schedule.num_microbatches, schedule.num_slices, per_token_loss=False)
    interpreter = PipelineInterpreter(schedule, 0, ops, None, [2, 2], SliceContext(), stores, loss)
    assert interpreter.forward_only
    interpreter.run()
    assert len(calls) == 2 * 3 * 2 and weight.grad is None
    assert len(loss.reports) == 3
