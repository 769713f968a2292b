"""How :func:`megatron_slim.runtime.spawn.run_ranks` starts a rank process and ties it to its caller.

Two start methods. ``spawn`` (the default, what ``megatron-slim train`` uses): each rank is a new
interpreter that imports torch and megatron-core itself. ``forkserver`` (:func:`use_forkserver`):
ranks fork from a server process that imported them once, for a caller that starts many short runs
(the test suite: a spawned rank spends about 4 s of CPU importing, most of a small multi-rank test).
A forked rank is still a fresh process with its own process group. Two things differ, and this
module evens them out: its parent is the fork server, not the caller (the server exits when the
caller does once no rank holds its "caller alive" pipe, so dying with the parent still chains to
the caller: :func:`let_the_fork_server_go`), and it would inherit the server's environment
variables, standard output and error, not the caller's current ones (:class:`CallerContext`).

When ranks fail, :func:`died_without_result` names the ones that exited without a result (killed by
a signal, or a non-zero exit): a rank killed outright makes its peers fail first in their
collectives, and their tracebacks alone would blame a survivor.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from multiprocessing import reduction
from typing import Any, Optional

import torch.multiprocessing as mp

START_METHODS = ("spawn", "forkserver")
_PR_SET_PDEATHSIG = 1
_method = "spawn"


def use_forkserver(preload: list[str]) -> None:
    """Start later ranks of this process from a fork server that imports ``preload`` once.

    The server starts with the first rank; it must run no torch operation before forking (none of
    ``preload`` does at import), so no thread pool is inherited half-built.
    """
    global _method
    mp.get_context("forkserver").set_forkserver_preload(list(preload))
    _method = "forkserver"


def start_method() -> str:
    """How ranks start now: one of :data:`START_METHODS`."""
    return _method


def rank_context() -> Any:
    return mp.get_context(_method)


def expected_parent() -> Optional[int]:
    """The PID a new rank's parent will have: this process when spawned; None (the fork server,
    known only to the rank) when forked."""
    return os.getpid() if _method == "spawn" else None


class CallerContext:
    """What a spawned rank inherits from its caller and a forked one would not: the caller's
    environment variables and its file descriptors 1 and 2 as they are when the rank starts.
    (multiprocessing already gives a forked rank the caller's working folder and ``sys.path``.)

    Pickled into the rank's start arguments (only the caller pickles it), it carries a copy of
    ``os.environ`` and duplicates of descriptors 1 and 2 (the start method's own descriptor passing);
    in the rank, :meth:`attach` installs them. A spawned rank has all of this already, so it gets
    None instead.
    """

    def __init__(self, environ: Optional[dict[str, str]] = None, stdio: Optional[tuple[Any, Any]] = None):
        self._environ = environ
        self._stdio = stdio

    def __reduce__(self):
        return (CallerContext, (dict(os.environ), (reduction.DupFd(1), reduction.DupFd(2))))

    @classmethod
    def for_start_method(cls) -> Optional[CallerContext]:
        return None if _method == "spawn" else cls()

    def attach(self) -> None:
        if self._environ is None or self._stdio is None:
            raise RuntimeError("CallerContext.attach: only in the rank it was sent to")
        os.environ.clear()
        os.environ.update(self._environ)
        sys.stdout.flush()
        sys.stderr.flush()
        for target, duplicated in zip((1, 2), self._stdio):
            fd = duplicated.detach()
            os.dup2(fd, target)
            os.close(fd)


def let_the_fork_server_go() -> None:
    """In a forked rank: close this process's copy of the fork server's "caller alive" pipe.

    The server exits when every holder of that pipe's write end has closed it. multiprocessing gives
    each forked child a copy (``_forkserver_alive_fd``, private; Python 3.10-3.12 keep it there), so
    a rank would keep the server, and with it the rank itself (``die_with_parent``), alive after the
    caller is killed outright. Ranks start no processes of their own from the server.
    """
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        os.close(fd)
        server._forkserver_alive_fd = None  # type: ignore[union-attr]


def die_with_parent(parent_pid: Optional[int]) -> None:
    """Make this process die when its parent does (Linux: PR_SET_PDEATHSIG=SIGKILL); ``None``: the
    parent this process has now (a forked rank's fork server).

    Exits at once if the parent is already gone (it died before the request took effect). Note
    that Linux sends the signal when the parent *thread* that started this process exits; callers
    of ``run_ranks`` block in that thread until the ranks are done, so that is the same thing.
    """
    if parent_pid is None:
        let_the_fork_server_go()
        parent_pid = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):  # pragma: no cover - exotic libc
            _watch_parent(parent_pid)
    else:  # pragma: no cover - no PDEATHSIG: poll
        _watch_parent(parent_pid)
    if os.getppid() != parent_pid:
        os._exit(1)


def _watch_parent(parent_pid: int) -> None:
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


DEATH_GRACE_S = 1.0  # after a rank's error: how long to look for a rank that died without one


def died_without_result(procs: list, results: dict[int, Any], wait_s: float = 0.0) -> Optional[str]:
    """One line naming the ranks that exited without a result, with their exit signal or code."""
    deadline = time.monotonic() + wait_s
    while True:
        dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in results]
        if dead or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    if not dead:
        return None
    return "; ".join(f"rank {i} died ({_exit_reason(procs[i].exitcode)}) without a result" for i in dead)


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
