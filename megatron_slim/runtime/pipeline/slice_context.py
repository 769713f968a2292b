"""Which microbatch slice a rank is computing right now.

The interpreter sets it around every forward and backward (marked ``recompute``: a forward run
inside a backward rebuilds checkpointed activations); the slice attention (K/V cache key, prefix
length, whether to append) and the rotary wrapper (positions) read it. One object per model-chunk set,
injected at the edge: no module-level state. ``documents`` holds each microbatch's document lengths
when its batch is a pack (``runtime/pipeline/documents.py``), recorded by the slicing data iterator.
``cp_shares`` holds, per microbatch a CP engine planned (``megatron-slim train`` with slices and
``cp.engine``, ``train/cp_slices.py``), which rows of each slice every CP rank holds: the slice
attention and RoPE then follow the plan instead of the zigzag split.
``documents_on_every_tp_rank``: every tensor-parallel rank knows each microbatch's documents, because
it reads its own batch (``megatron-slim train``) or TP rank 0 handed them over (the launcher's
SlimPipe schedule under ``--slimpipe-packing``); false under Megatron's TP batch broadcast alone,
which carries tensors only, so packed windows then refuse tensor parallelism.
``exchange`` is the run's context exchange while a schedule with pairs runs (``exchanging(action)``
tells it which action is running), else None.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from megatron_slim.plan.cp.slices import SliceShare
from megatron_slim.runtime.pipeline.documents import DocumentTable

if TYPE_CHECKING:
    from megatron_slim.plan.schedule.ir import Action
    from megatron_slim.runtime.pipeline.context_exchange import ContextExchange
    from megatron_slim.runtime.pipeline.dp_merge import MergeLink


@dataclass(frozen=True)
class SliceInfo:
    microbatch: int
    slice: int
    num_slices: int
    start: int  # first token position of the slice in its sequence
    length: int  # tokens in the slice (the whole sequence, not the CP/SP shard)
    forward_only: bool = False
    # set around a backward action: a forward run then is activation recomputation, which reads
    # the slice's cached K/V prefix and must not append the slice to the cache a second time
    recompute: bool = False

    @property
    def is_last(self) -> bool:
        return self.slice == self.num_slices - 1


class SliceContext:
    def __init__(self, *, documents_on_every_tp_rank: bool = False) -> None:
        self._current: SliceInfo | None = None
        self.documents = DocumentTable()
        self.cp_shares: dict[int, tuple[SliceShare, ...]] = {}
        self.documents_on_every_tp_rank = documents_on_every_tp_rank
        self.exchange: Optional["ContextExchange"] = None
        self.dp_merge: Optional["MergeLink"] = None  # ``megatron-slim train`` with DP-merge (``dp_merge.py``)

    def exchanging(self, action: "Action") -> AbstractContextManager:
        """Around any action: a compute action's attention layers meet its exchange partner's."""
        if self.exchange is None or not action.kind.is_compute:
            return nullcontext()
        return self.exchange.scope(action)

    @property
    def current(self) -> SliceInfo | None:
        """None outside a schedule (plain unsliced forward): attention then runs uncached."""
        return self._current

    def enter(self, info: SliceInfo) -> "SliceContext":
        if self._current is not None:
            raise RuntimeError(f"slice context already holds {self._current}; nested entry of {info}")
        self._current = info
        return self

    def __enter__(self) -> "SliceContext":
        return self

    def __exit__(self, *exc) -> None:
        self._current = None
