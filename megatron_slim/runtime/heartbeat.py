"""A watchdog for ranks that stop responding, like NCCL's: a rank that is stopped (SIGSTOP), frozen
in a system call or swapped out for good hangs its peers in their next collective with no message.

Each rank of :func:`megatron_slim.runtime.spawn.run_ranks` (with ``watchdog_s``) runs a daemon
thread that writes ``heartbeat/<rank>`` to the run's store every ``watchdog_s / 10`` seconds: a
counter and the step the rank's main thread last announced (:func:`set_step`, e.g. ``iteration
3``). The thread beats while its main thread waits in a collective, so a rank that merely waits
for a stopped peer keeps beating; a stopped process beats no more. The parent (:class:`Watch`)
notes when each rank's counter last changed and, past ``watchdog_s`` without a change, names the
rank and its step; ``run_ranks`` then stops every rank.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Optional

KEY = "heartbeat/{rank}"
_step = "starting"  # this rank's current step: one rank per process, set by its main thread


def set_step(text: str) -> None:
    """What this rank is doing now, for the watchdog's message if it stops responding."""
    global _step
    _step = text


def start_beating(store: Any, rank: int, watchdog_s: float) -> None:
    every = max(0.05, watchdog_s / 10)

    def beat() -> None:
        count = 0
        while True:
            count += 1
            try:
                store.set(KEY.format(rank=rank), f"{count} {_step}")
            except Exception:  # noqa: BLE001 - the store is gone: the run is over
                return
            time.sleep(every)

    threading.Thread(target=beat, name="heartbeat", daemon=True).start()


class Watch:
    """The parent's view of every rank's heartbeat."""

    def __init__(self, store: Any, world_size: int, watchdog_s: float, clock=time.monotonic) -> None:
        self.store, self.world_size, self.watchdog_s, self.clock = store, world_size, watchdog_s, clock
        started = clock()
        self.last: dict[int, tuple[str, float]] = {r: ("", started) for r in range(world_size)}

    def silent(self, finished: set[int]) -> Optional[str]:
        """One line naming the ranks (not in ``finished``) silent for longer than ``watchdog_s``."""
        now = self.clock()
        silent = []
        for rank in range(self.world_size):
            if rank in finished:
                continue
            key = KEY.format(rank=rank)
            value = self.store.get(key).decode() if self.store.check([key]) else ""
            seen, since = self.last[rank]
            if value != seen:
                self.last[rank] = (value, now)
            elif now - since > self.watchdog_s:
                step = value.split(" ", 1)[1] if " " in value else "start-up"
                silent.append(
                    f"rank {rank} stopped responding ({now - since:.0f} s without a heartbeat; last at {step})"
                )
        return "; ".join(silent) or None
