"""What every group task needs while it runs one pass: the comm, the kernels and the tensor facts."""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Optional

import torch
from torch.profiler import record_function

from megatron_slim.plan.cp.program import GroupTask, Step
from megatron_slim.runtime.attention import AttentionBackend
from megatron_slim.runtime.cp.comm import Comm

Tensor = torch.Tensor


@dataclass(frozen=True)
class HeadShape:
    """Heads and head sizes of one layer's attention on this tensor-parallel rank."""

    hq: int
    hkv: int
    d: int  # query/key head size
    dv: int  # value head size

    @classmethod
    def of(cls, q: Tensor, k: Tensor, v: Tensor) -> "HeadShape":
        return cls(q.shape[1], k.shape[1], q.shape[2], v.shape[2])


@dataclass(frozen=True)
class RunContext:
    comm: Comm
    backend: AttentionBackend
    scale: float
    dtype: torch.dtype  # of q/k/v and of the messages carrying them
    device: torch.device
    walked: Optional[dict] = field(default=None, compare=False)  # group -> step strings run, when recording
    backward: bool = False  # the pass runs the tasks' backward steps

    def record(self, group: int) -> Optional[list]:
        return None if self.walked is None else self.walked.setdefault(group, [])

    @property
    def acc_dtype(self) -> torch.dtype:
        """Accumulators and travelling dK/dV: float32, or float64 for float64 inputs."""
        return torch.promote_types(self.dtype, torch.float32)


def walk_steps(
    task: GroupTask, steps: Iterable[Step], rt: RunContext, run_step: Callable[[Step], None]
) -> Iterator[None]:
    """Generator over some of ``task``'s steps: ``run_step(step)`` for each, a yield at each ``ROUND``.

    Each step is recorded when ``rt`` records, and under torch's profiler runs inside
    ``record_function(task.step_name(...))``: the name the simulator's CP trace gives it."""
    walked = rt.record(task.group)
    for step in steps:
        if walked is not None:
            walked.append(str(step))
        if step.op == "ROUND":
            yield
            continue
        profiled = torch.autograd._profiler_enabled()
        with record_function(task.step_name(step, rt.backward)) if profiled else nullcontext():
            run_step(step)


def pack(*tensors: Tensor) -> Tensor:
    """``[rows, heads_i, d_i]`` tensors side by side as one contiguous ``[rows, sum(heads_i * d_i)]``."""
    return torch.cat([flat2d(t) for t in tensors], dim=1).contiguous()


def flat2d(t: Tensor) -> Tensor:
    """``[rows, ...]`` -> ``[rows, features]`` (also for zero rows, where ``reshape(rows, -1)`` fails)."""
    return t.reshape(t.shape[0], math.prod(t.shape[1:]))


def unpack(message: Tensor, *shapes: tuple[int, int]) -> list[Tensor]:
    """Views ``[rows, heads, d]`` of a packed message (the inverse of ``pack``)."""
    out, col = [], 0
    for heads, d in shapes:
        out.append(message[:, col : col + heads * d].view(message.shape[0], heads, d))
        col += heads * d
    if col != message.shape[1]:
        raise ValueError(f"message of width {message.shape[1]} does not hold {shapes}")
    return out
