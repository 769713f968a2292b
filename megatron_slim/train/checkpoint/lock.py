"""One run per checkpoint directory.

Two jobs started on the same ``--checkpoint-dir`` would both train and interleave their
checkpoints (``iter_2`` from one, ``iter_4`` from the other), and a resume would silently continue
a different run. The run that reports (the ``train`` process, or rank 0 under torchrun) holds an
exclusive ``flock`` on ``DIR/.megatron-slim.lock`` for as long as it runs, with its host, PID and
start time written in it; a second run refuses at start-up, naming them. The kernel releases the
lock when its holder exits, however it exits, so a killed run leaves nothing to clean up.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from pathlib import Path
from typing import Iterator

from megatron_slim.plan.schema import ConfigError

LOCK_FILE = ".megatron-slim.lock"


@contextlib.contextmanager
def only_run_in(directory: str) -> Iterator[None]:
    """Hold ``directory``'s run lock for the block; ``ConfigError`` naming the holder if another has it."""
    path = Path(directory) / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 512, 0).decode("utf-8", "replace").strip() or "a run that has not said who it is"
        os.close(fd)
        raise ConfigError(
            f"--checkpoint-dir {directory}: another run is training into it ({holder}); allowed: a directory "
            "no running job uses (wait for that run to end, or stop it)"
        ) from None
    try:
        os.ftruncate(fd, 0)
        started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        os.pwrite(fd, f"host {socket.gethostname()}, pid {os.getpid()}, since {started}\n".encode(), 0)
        yield
    finally:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
