"""What the pipeline interpreter runs against: the model side (``StageOps``), the per-step state it
keeps (``RunState``) and the error it raises when schedule and state disagree."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

Unit = tuple[int, int, int]  # (chunk, microbatch, slice)


class PipelineStateError(RuntimeError):
    """The runtime found the schedule and its own state disagreeing (a bug, never a user error)."""


@dataclass
class StageOps:
    """The model side, supplied by the Megatron adapter or by tests.

    ``forward(chunk, input)`` runs the chunk's forward step for the slice set in the context and
    returns ``(output, loss_func)`` (loss_func is used on the last stage); ``backward(input,
    output, output_grad)`` back-propagates and returns the input's gradient (None on the first
    stage); ``tensor_shape(microbatch, slice)`` is the shape of a slice's hidden states between
    stages (per microbatch: under data-dependent context-parallel plans it varies).
    """

    forward: Callable[[int, Optional[torch.Tensor]], tuple]
    backward: Callable[[Optional[torch.Tensor], torch.Tensor, Optional[torch.Tensor]], Optional[torch.Tensor]]
    tensor_shape: Callable[[int, int], tuple]
    dtype: torch.dtype
    release_output: Callable[[torch.Tensor], None] = lambda t: None


@dataclass
class RunState:
    inputs: dict = field(default_factory=dict)  # unit -> received (or handed-over) input
    outputs: dict = field(default_factory=dict)  # unit -> (input, output) kept for backward
    grads: dict = field(default_factory=dict)  # unit -> output gradient
    to_send: dict = field(default_factory=dict)  # unit -> input gradient awaiting SEND_B
