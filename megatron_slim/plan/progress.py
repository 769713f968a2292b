"""Progress of long pure computations, reported through a callback (planners never print).

A planner or simulator that can take seconds accepts ``progress: Progress | None`` and calls
``progress(phase, done, total)`` now and then (every ``EVERY`` steps of a loop, or once per pack);
the command layer (``megatron_slim.commands.progress``) decides whether and how to show it.
"""

from __future__ import annotations

from typing import Callable, Optional

Progress = Callable[[str, int, int], None]  # (phase, done, total)
EVERY = 4096  # loop steps between two calls: keeps the callback's cost out of the timings


def report(progress: Optional[Progress], phase: str, done: int, total: int) -> None:
    if progress is not None:
        progress(phase, done, total)
