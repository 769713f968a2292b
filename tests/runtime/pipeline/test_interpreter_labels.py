"""Under torch's profiler every action the interpreter runs is one event named by the schedule IR's
action string (``F1.2``, ``1B0.1``): the names the simulator's traces use."""

import torch
from torch.profiler import ProfilerActivity, profile

from megatron_slim.plan.schedule import generate, lower
from megatron_slim.runtime.pipeline.interpreter import PipelineInterpreter, StageOps
from megatron_slim.runtime.pipeline.kv_cache import KVCacheStore
from megatron_slim.runtime.pipeline.loss import SlicedLoss
from megatron_slim.runtime.pipeline.slice_context import SliceContext

HIDDEN = 4


def _interpreter(schedule, weight):
    def forward(chunk, inp):
        x = torch.ones(2, 1, HIDDEN) if inp is None else inp
        out = x * weight[chunk]
        return out, lambda o: (o.sum(), torch.tensor(o.numel()), {"lm loss": o.sum().detach()})

    def backward(inp, out, grad):
        torch.autograd.backward(out, grad)
        return inp.grad if inp is not None else None

    ops = StageOps(forward=forward, backward=backward, tensor_shape=lambda mb, j: (2, 1, HIDDEN), dtype=torch.float32)
    stores = [KVCacheStore() for _ in range(schedule.vpp)]
    loss = SlicedLoss(schedule.num_microbatches, schedule.num_slices, per_token_loss=False)
    return PipelineInterpreter(schedule, 0, ops, None, [2] * schedule.num_slices, SliceContext(), stores, loss)


def test_each_action_is_one_profiler_event_named_by_its_ir_string():
    schedule = lower(generate("interleaved", 1, 2, 3, 1))  # one rank, two chunks: names like 1F0.0
    weight = torch.ones(2, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _interpreter(schedule, weight).run()
    expected = [str(a) for a in schedule.ranks[0]]
    names = {str(a) for a in schedule.ranks[0]}
    recorded = [e.name for e in sorted(prof.events(), key=lambda e: e.time_range.start) if e.name in names]
    assert recorded == expected and any(n.startswith("1") for n in expected)
    assert weight.grad is not None


def test_actions_run_unlabelled_without_a_profiler(monkeypatch):
    """Off the profiler the interpreter does not enter ``record_function`` at all."""
    import megatron_slim.runtime.pipeline.interpreter as interpreter

    entered = []
    monkeypatch.setattr(interpreter, "record_function", lambda name: entered.append(name))
    schedule = lower(generate("1f1b", 1, 1, 2, 1))
    _interpreter(schedule, torch.ones(1, requires_grad=True)).run()
    assert entered == []


def test_labels_equal_the_simulated_trace_names_of_the_same_recipe():
    """The runtime's profiler labels, in order, are the names of the simulator's Chrome trace events
    (``plan.sim.trace``) for the same recipe: ``F3.2``, never a prefixed form like ``PP:F3.2``."""
    from megatron_slim.commands.simulate import run_one
    from megatron_slim.plan.recipe import load_recipe
    from megatron_slim.plan.sim.trace import chrome_trace

    result = run_one(load_recipe("tiny-cpu", ["parallel.pp=1", "train.global_batch_size=3"])).result
    trace = [e for e in chrome_trace(result)["traceEvents"] if e["ph"] == "X" and e["pid"] == 0]
    simulated = [e["name"] for e in sorted(trace, key=lambda e: e["ts"])]
    weight = torch.ones(1, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _interpreter(result.schedule, weight).run()
    names = set(simulated)
    recorded = [e.name for e in sorted(prof.events(), key=lambda e: e.time_range.start) if e.name in names]
    assert recorded == simulated and len(simulated) == 2 * 3 * 4
    assert not any(":" in e.name and e.name.split(":")[-1] in names for e in prof.events())
