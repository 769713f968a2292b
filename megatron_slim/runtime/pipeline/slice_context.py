"""Which microbatch slice a rank is computing right now.

The interpreter sets it around every forward and backward (marked ``recompute``: a forward run
inside a backward rebuilds checkpointed activations); the slice attention (K/V cache key, prefix
length, whether to append) and the rotary wrapper (positions) read it. One object per model-chunk set,
injected at the edge: no module-level state. ``documents`` holds each microbatch's document lengths
when its batch is a pack (``runtime/pipeline/documents.py``), recorded by the slicing data iterator.
``exchange`` is the run's context exchange while a schedule with pairs runs (``exchanging(action)``
tells it which action is running), else None.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from megatron_slim.runtime.pipeline.documents import DocumentTable

if TYPE_CHECKING:
    from megatron_slim.plan.schedule.ir import Action
    from megatron_slim.runtime.pipeline.context_exchange import ContextExchange


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
    def __init__(self) -> None:
        self._current: SliceInfo | None = None
        self.documents = DocumentTable()
        self.exchange: Optional["ContextExchange"] = None

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
