"""Rank function for the point-to-point hygiene tests (module level so spawn can import it).

A toy two-rank pipeline (each chunk multiplies its input by one weight) run by the real
interpreter over gloo, with Megatron's way of releasing a sent output (``out.data`` swapped for a
one-element tensor, ``deallocate_output_tensor``) and its way of back-propagating through such an
output (the autograd engine called directly, as ``custom_backward`` does).
"""

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef

from megatron_slim.plan.schedule.executable import executable
from megatron_slim.runtime.pipeline.interpreter import PipelineInterpreter, StageOps
from megatron_slim.runtime.pipeline.kv_cache import KVCacheStore
from megatron_slim.runtime.pipeline.loss import SlicedLoss
from megatron_slim.runtime.pipeline.memory_meter import ActivationMeter
from megatron_slim.runtime.pipeline.p2p import P2P
from megatron_slim.runtime.pipeline.slice_context import SliceContext

TOKENS, HIDDEN = 8, 16  # one slice's message: TOKENS x 1 x HIDDEN fp32
MESSAGE_BYTES = TOKENS * HIDDEN * 4


def _release(out: torch.Tensor) -> None:
    out.data = torch.empty((1,), dtype=out.dtype)


def _backward(inp, out, grad):
    if grad is None:
        torch.autograd.backward(out)
    else:
        torch.autograd.Variable._execution_engine.run_backward(
            tensors=(out,), grad_tensors=(grad,), keep_graph=False, create_graph=False,
            inputs=(), allow_unreachable=True, accumulate_grad=True,
        )  # fmt: skip
    return inp.grad if inp is not None else None


def run(rank, world_size, kind, vpp, microbatches, slices):
    """Run one step; returns per-forward counts of sent storages still alive (rank's own sends),
    the number of sends, what is alive after the step, and the meter's in-flight figures."""
    schedule = executable(kind, world_size, vpp, microbatches, slices)
    weight = torch.nn.Parameter(torch.full((vpp,), 1.01))
    sent: list[StorageWeakRef] = []
    alive_at_forward: list[int] = []

    def forward(chunk, inp):
        alive_at_forward.append(sum(not ref.expired() for ref in sent))
        x = torch.ones(TOKENS, 1, HIDDEN) if inp is None else inp
        out = x * weight[chunk]
        if schedule.stage(rank, chunk) < schedule.num_stages - 1:  # an output that is sent
            sent.append(StorageWeakRef(out.untyped_storage()))
        return out, lambda o: (o.sum(), torch.tensor(o.numel()), {"lm loss": o.sum().detach()})

    ops = StageOps(forward, _backward, lambda mb, j: (TOKENS, 1, HIDDEN), torch.float32, release_output=_release)
    p2p = P2P(None, list(range(world_size)), torch.device("cpu"), schedule.num_stages, microbatches, slices)
    meter = ActivationMeter([weight])
    stores = [KVCacheStore() for _ in range(vpp)]
    loss = SlicedLoss(microbatches, slices, per_token_loss=False)
    interpreter = PipelineInterpreter(schedule, rank, ops, p2p, [TOKENS] * slices, SliceContext(), stores, loss, meter)
    interpreter.run()
    dist.barrier()
    return {
        "alive_at_forward": alive_at_forward,
        "sends": sum(a.kind.name.startswith("SEND") for a in schedule.ranks[rank]),
        "alive_after": sum(not ref.expired() for ref in sent),
        "peak_p2p_bytes": meter.p2p.peak_bytes,
        "peak_recv_bytes": meter.p2p.peak_recv_bytes,
        "live_p2p_bytes": meter.p2p.live_bytes,
        "grad": weight.grad.clone(),
        "posted_ahead": interpreter.posted_ahead,
    }
