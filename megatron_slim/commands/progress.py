"""A progress line on stderr for commands that can run for more than a few seconds.

The planners and simulators report through a callback (``megatron_slim.plan.progress``); this is
what shows it. Never on stdout, where ``--json -`` writes JSON.

* stderr is a terminal: one line redrawn in place, at most every ``0.2 s`` from ``0.5 s`` on, and
  erased when the work is done (the results print as before);
* otherwise (a log file, CI): nothing for runs shorter than ``5 s``; then one line every ``10 s``
  and a closing ``done in`` line.

A line reads ``megatron-slim simulate: engine ring (2/6): 37/128 packs | 12.4 s elapsed | ETA 31 s``;
the ETA is the remaining work at the rate since the current series of updates began.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, Hashable, Optional, TextIO

TTY_TIMING = (0.5, 0.2)  # first line after, then at most every (seconds)
LOG_TIMING = (5.0, 10.0)


def duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(int(round(seconds)), 60)
    return f"{minutes} min {rest:02d} s"


class ProgressLine:
    def __init__(
        self,
        command: str,
        stream: Optional[TextIO] = None,
        *,
        tty: Optional[bool] = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.command = command
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.tty = bool(isatty and isatty()) if tty is None else tty
        self.first_s, self.every_s = TTY_TIMING if self.tty else LOG_TIMING
        self.clock = clock
        self.start = clock()
        self.last_shown: Optional[float] = None
        self.lines = 0
        self._series: tuple = (object(), self.start, 0)  # (key, started, done then)

    def __enter__(self) -> "ProgressLine":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(finished=exc_type is None)

    def update(self, text: str, done: int, total: int, series: Hashable = None) -> None:
        """``text`` says what is under way; ``done`` of ``total`` units of the ``series`` give the ETA."""
        now = self.clock()
        if series != self._series[0]:
            self._series = (series, now, done)
        if now - self.start < self.first_s or (self.last_shown is not None and now - self.last_shown < self.every_s):
            return
        self.last_shown = now
        line = f"{self.command}: {text} | {duration(now - self.start)} elapsed | ETA {self._eta(done, total, now)}"
        self.stream.write("\r" + line + "\x1b[K" if self.tty else line + "\n")
        self.stream.flush()
        self.lines += 1

    def _eta(self, done: int, total: int, now: float) -> str:
        _, started, done_then = self._series
        if done >= total:
            return duration(0.0)
        if done <= done_then or now <= started:
            return "?"
        return duration((total - done) * (now - started) / (done - done_then))

    def close(self, finished: bool = True) -> None:
        """Erase the terminal line, or close the log's lines with the total time."""
        if not self.lines:
            return
        if self.tty:
            self.stream.write("\r\x1b[K")
        else:
            self.stream.write(
                f"{self.command}: {'done in' if finished else 'stopped after'} {duration(self.clock() - self.start)}\n"
            )
        self.stream.flush()
        self.lines = 0
