"""Megatron's gradient-synchronisation hooks, per model chunk.

``no_sync_func`` (one callable, or one per chunk) holds DDP's gradient reduction back; it is
entered before the first backward. With ``grad_sync_func`` (Megatron's overlapped, aligned
reduction), a chunk's reduction is launched right after its last backward; without it, the chunk's
``no_sync`` context is left just before its last backward so DDP's hooks reduce during it.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence


def _per_chunk(value, num_chunks: int) -> list | None:
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        if len(value) != num_chunks:
            raise ValueError(f"expected {num_chunks} per-chunk hooks, got {len(value)}")
        return list(value)
    return None


class GradSync:
    def __init__(
        self,
        no_sync_func,
        grad_sync_func,
        chunk_params: Sequence[Callable[[], object]],
        last_backward_step: dict[int, int],
    ) -> None:
        """``last_backward_step[chunk]`` is the step of the chunk's last backward on this rank."""
        self.num_chunks = len(chunk_params)
        self.chunk_params = chunk_params
        self.last_step = last_backward_step
        self._no_sync_list = _per_chunk(no_sync_func, self.num_chunks)
        self._no_sync_single = no_sync_func if self._no_sync_list is None else None
        self._grad_sync_list = _per_chunk(grad_sync_func, self.num_chunks)
        self._grad_sync_single = grad_sync_func if self._grad_sync_list is None else None
        self._stacks: dict[int, contextlib.ExitStack] = {}
        self._single: contextlib.ExitStack | None = None
        self._synced: set[int] = set()

    def start(self) -> None:
        if self._no_sync_list is not None:
            for c, fn in enumerate(self._no_sync_list):
                self._stacks[c] = contextlib.ExitStack()
                self._stacks[c].enter_context(fn())
        elif self._no_sync_single is not None:
            self._single = contextlib.ExitStack()
            self._single.enter_context(self._no_sync_single())

    def _enable(self, chunk: int | None) -> None:
        if chunk is not None and chunk in self._stacks:
            self._stacks.pop(chunk).close()
        if (chunk is None or not self._stacks) and self._single is not None:
            self._single.close()
            self._single = None

    def before_backward(self, chunk: int, step: int) -> None:
        if step == self.last_step[chunk] and self._grad_sync_list is None and self._grad_sync_single is None:
            last_overall = step == max(self.last_step.values())
            self._enable(chunk if self._no_sync_list is not None else (None if last_overall else -1))

    def after_backward(self, chunk: int, step: int) -> None:
        if step != self.last_step[chunk] or self._grad_sync_list is None:
            return
        self._enable(chunk)
        self._grad_sync_list[chunk](self.chunk_params[chunk]())
        self._synced.add(chunk)

    def finish(self) -> None:
        for chunk in list(self._stacks):
            self._enable(chunk)
        self._enable(None)
        if self._grad_sync_list is not None:
            for c in range(self.num_chunks):
                if c not in self._synced:
                    self._grad_sync_list[c](self.chunk_params[c]())
        elif self._grad_sync_single is not None:
            for c in range(self.num_chunks):
                self._grad_sync_single(self.chunk_params[c]())


class ParamSync:
    """Megatron's ``param_sync_func`` (distributed optimizer with ``--overlap-param-gather`` and
    aligned gathers): launches the parameter all-gather of a model chunk ahead of its first forward.

    As megatron's interleaved schedule does, chunks 0 and 1 are launched when the step starts; chunk
    ``c + 1`` when chunk ``c`` runs its first forward. DDP's forward pre-hook waits for (or, if none
    was launched, runs) the gather, so the timing affects overlap only, never the result.
    """

    def __init__(self, param_sync_func, chunk_params: Sequence[Callable[[], object]]) -> None:
        self.num_chunks = len(chunk_params)
        self.chunk_params = chunk_params
        funcs = _per_chunk(param_sync_func, self.num_chunks)
        self.funcs = (
            funcs
            if funcs is not None
            else ([param_sync_func] * self.num_chunks if param_sync_func is not None else None)
        )
        self._launched: set[int] = set()

    def _launch(self, chunk: int) -> None:
        if self.funcs is not None and chunk < self.num_chunks and chunk not in self._launched:
            self._launched.add(chunk)
            self.funcs[chunk](self.chunk_params[chunk]())

    def start(self) -> None:
        for chunk in (0, 1):
            self._launch(chunk)

    def before_forward(self, chunk: int) -> None:
        self._launch(chunk)
        self._launch(chunk + 1)
