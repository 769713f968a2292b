"""The CP engine's core attention for models run by megatron-slim's schedule adapter (``slimpipe/schedule.py``).

The adapter runs every schedule kind (1F1B, interleaved, SlimPipe) through the slice interpreter
and refuses a model in which ``attach_slicing`` finds no ``SliceCoreAttention``. Under a CP engine
each microbatch is one slice whose layers run the engine on the microbatch's plan, so
``CPScheduledCoreAttention`` is a ``SliceCoreAttention`` for that check and a ``CPCoreAttention``
for the work: it always runs the engine and needs a plan (set by ``megatron_slim.train.cp`` before
every forward). Both parents keep their context in ``self.context``; here the ``SliceContext`` the
adapter attaches is kept apart (``slice_context``) and ``context`` stays the ``CPContext``.
Several SlimPipe slices per microbatch do not run through this attention: ``megatron-slim train``
and the launcher then run ``SliceCoreAttention`` on each window's plan (``train/cp_slices.py``,
``megatron/slimpipe/engine_slices.py``, ``docs/cp-pipeline.md``).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_slim.megatron.cp.attention import CPCoreAttention
from megatron_slim.megatron.slimpipe.slicing import SliceCoreAttention
from megatron_slim.runtime.pipeline.slice_context import SliceContext


class CPScheduledCoreAttention(CPCoreAttention, SliceCoreAttention):
    slice_context: Any = None

    @property
    def context(self):
        return self.__dict__.get("_cp_context")

    @context.setter
    def context(self, value) -> None:
        if isinstance(value, SliceContext):
            self.__dict__["slice_context"] = value
        else:
            self.__dict__["_cp_context"] = value

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.context is None or self.context.plan is None:
            raise RuntimeError(
                f"layer {self.layer_number}: context-parallel attention has no plan; the forward step "
                "must call context.set_plan(...) before every microbatch"
            )
        return CPCoreAttention.attend(self, q, k, v)
