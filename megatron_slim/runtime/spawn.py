"""Run a function on N local ranks joined by torch.distributed (gloo on CPU).

Used by ``megatron-slim train`` to launch its own ranks and by the multi-process tests. A failure
on any rank raises in the parent with that rank's traceback; no rank is left hanging.

Rendezvous: the parent owns it. It opens a ``TCPStore`` server on port 0 (the kernel picks a free
port and the server keeps it bound for the whole run) and the ranks join that store as clients, so
no port is ever chosen, released and re-bound later by someone else (the old ``free_port()`` race:
EADDRINUSE under load). Gloo's own connections use ports gloo binds itself.

Lifetime: rank processes never outlive the parent. Each rank asks Linux to SIGKILL it when the
parent dies (``prctl(PR_SET_PDEATHSIG)``; this covers a parent killed with SIGKILL) and exits at
once if the parent is already gone by then (``rank_start``, which also offers a preloaded fork
server in place of spawning, for callers that start many short runs). While ``run_ranks`` runs in
the main thread, SIGTERM and SIGINT in the parent stop every rank (terminate, then kill after a
short grace) and raise :class:`Interrupted`. Ranks ignore SIGINT themselves: Ctrl-C reaches the whole foreground process
group and the parent decides.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue as queue_module
import signal
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from megatron_slim.runtime.heartbeat import Watch, start_beating
from megatron_slim.runtime.nccl_rules import install_if_asked
from megatron_slim.runtime.rank_start import (
    DEATH_GRACE_S,
    CallerContext,
    die_with_parent,
    died_without_result,
    expected_parent,
    rank_context,
)

HOST = "127.0.0.1"
STOP_GRACE_S = 5.0  # after SIGTERM to the ranks, how long before SIGKILL


class RankFailed(RuntimeError):
    """A spawned rank raised; the message holds its traceback."""


class Interrupted(KeyboardInterrupt):
    """The parent got SIGTERM or SIGINT while its ranks ran; the ranks have been stopped."""

    def __init__(self, signum: int):
        self.signum = int(signum)
        super().__init__(f"interrupted by {signal.Signals(self.signum).name}")


def host_rendezvous(host: str = HOST, timeout_s: float = 600.0) -> dist.TCPStore:
    """The ranks' rendezvous: a ``TCPStore`` server in this process on a port the kernel picks.

    The port is bound from this call until the store is dropped, so nothing else can take it
    between choosing it and the ranks joining (``store.port``; ranks join as clients).
    """
    return dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))


def _worker(
    rank: int,
    world_size: int,
    port: int,
    parent_pid: Optional[int],
    caller: Optional[CallerContext],
    backend: str,
    threads: int,
    timeout_s: float,
    watchdog_s: Optional[float],
    fn: Callable,
    args: tuple,
    queue: Any,
) -> None:
    die_with_parent(parent_pid)
    if caller is not None:  # a forked rank: the caller's environment and output, as a spawned one has
        caller.attach()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):  # started with SIGINT blocked (see run_ranks); now ignored instead
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    # What torchrun would set; an env:// init_process_group in here joins the parent's store as a client.
    os.environ.update(
        MASTER_ADDR=HOST,
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        TORCHELASTIC_USE_AGENT_STORE="True",
    )
    torch.set_num_threads(threads)
    try:
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(HOST, port, is_master=False, timeout=timeout)
        if watchdog_s:
            start_beating(store, rank, watchdog_s)
        install_if_asked()
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        result = fn(rank, world_size, *args)
        queue.put((rank, True, pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - report anything to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class _SignalGate:
    """Turns the first SIGTERM/SIGINT into :class:`Interrupted`, at once or, inside :meth:`held`,
    when the held block ends (so that e.g. a process start is never cut in half)."""

    def __init__(self) -> None:
        self.fired: Optional[int] = None
        self._held = 0

    def handler(self, signum, frame) -> None:
        if self.fired is None:  # later signals are swallowed: the clean-up must not be cut short
            self.fired = signum
            if not self._held:
                raise Interrupted(signum)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        self._held += 1
        try:
            yield
        finally:
            self._held -= 1
        if self.fired is not None and not self._held:
            raise Interrupted(self.fired)


@contextlib.contextmanager
def stop_on_signals(signals=(signal.SIGTERM, signal.SIGINT)) -> Iterator[_SignalGate]:
    """Turn the first of ``signals`` into :class:`Interrupted` in the main thread (elsewhere the
    handlers stay as they are); yields the gate, whose ``held()`` defers the exception."""
    gate = _SignalGate()
    if threading.current_thread() is not threading.main_thread():
        yield gate
        return
    previous = {s: signal.signal(s, gate.handler) for s in signals}
    try:
        yield gate
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


@contextlib.contextmanager
def _sigint_blocked_in_children() -> Iterator[None]:
    """Block SIGINT in this thread while it starts ranks: they inherit the mask, so a Ctrl-C while
    they still import is not a traceback from each of them. This process's other threads still
    take the signal, and its handler still runs in the main thread."""
    if not hasattr(signal, "pthread_sigmask"):  # pragma: no cover - not POSIX
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _reap(procs: list, stop: bool, wait_s: float) -> None:
    """Join the rank processes; with ``stop``, SIGTERM them first. Whatever is left is SIGKILLed."""
    if stop:
        for p in procs:
            if p.is_alive():
                p.terminate()
                with contextlib.suppress(OSError):  # a stopped rank (SIGSTOP) acts on SIGTERM once continued
                    os.kill(p.pid, signal.SIGCONT)
    deadline = time.monotonic() + wait_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def _stop_all(procs: list) -> None:
    try:
        _reap(procs, stop=True, wait_s=STOP_GRACE_S)
    except Interrupted:  # the one signal the gate raises for; it swallows any later ones
        _reap(procs, stop=True, wait_s=STOP_GRACE_S)
        raise


def run_ranks(
    fn: Callable,
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    threads_per_rank: int = 1,
    timeout_s: Optional[float] = 600.0,
    collective_timeout_s: float = 600.0,
    watchdog_s: Optional[float] = None,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes; return results by rank.

    ``fn`` must be importable (module level) and its result picklable. ``timeout_s`` bounds the
    whole run (None: no bound); ``collective_timeout_s`` bounds any one collective on a rank;
    ``watchdog_s`` (None: off) fails the run when a rank stops responding that long
    (``runtime.heartbeat``). A rank that raises, or dies without a result, fails the run at once
    and the others are stopped.
    SIGTERM/SIGINT to this process stop the ranks and raise :class:`Interrupted` (main thread).
    """
    ctx = rank_context()  # spawn, or a preloaded fork server (megatron_slim.runtime.rank_start)
    queue = ctx.Queue()
    store = host_rendezvous(timeout_s=collective_timeout_s)
    procs = [
        ctx.Process(
            target=_worker,
            args=(
                r,
                world_size,
                store.port,
                expected_parent(),
                CallerContext.for_start_method(),
                backend,
                threads_per_rank,
                collective_timeout_s,
                watchdog_s,
                fn,
                args,
                queue,
            ),
            daemon=True,
        )
        for r in range(world_size)
    ]
    with stop_on_signals() as gate:
        try:
            with gate.held(), _sigint_blocked_in_children():  # every started rank is in procs, to be stopped
                for p in procs:
                    p.start()
            watch = Watch(store, world_size, watchdog_s) if watchdog_s else None
            results, failure = _collect_results(procs, queue, timeout_s, watch)
        except BaseException:
            _stop_all([p for p in procs if p.pid is not None])
            raise
        _finish(procs, failure)
    del store
    if failure is not None:
        raise RankFailed(failure)
    return [results[r] for r in range(world_size)]


def _collect_results(
    procs: list, queue: Any, timeout_s: Optional[float], watch: Optional[Watch] = None
) -> tuple[dict[int, Any], Optional[str]]:
    """Each rank's result as it arrives, until all are in or one fails (then the reason why)."""
    world_size = len(procs)
    results: dict[int, Any] = {}
    failure = None
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while len(results) < world_size and failure is None:
        try:
            rank, ok, payload = queue.get(timeout=2.0)
        except queue_module.Empty:
            dead = died_without_result(procs, results)
            silent = watch.silent(set(results)) if watch is not None and not dead else None
            if dead or silent:
                failure = dead or silent
            elif deadline is not None and time.monotonic() > deadline:
                failure = (
                    f"ranks {sorted(set(range(world_size)) - set(results))} produced no result within {timeout_s:.0f}s"
                )
            continue
        if ok:
            results[rank] = pickle.loads(payload)
        else:
            failure = f"rank {rank} failed:\n{payload}"
            dead = died_without_result(procs, results, wait_s=DEATH_GRACE_S)
            if dead:  # a rank killed outright makes its peers fail first: name it, then them
                failure = f"{dead}; then {failure}"
    return results, failure


def _finish(procs: list, failure: Optional[str]) -> None:
    """Stop the ranks after a failure; otherwise let them exit on their own (stopped if interrupted)."""
    if failure is not None:
        _stop_all(procs)
        return
    try:
        _reap(procs, stop=False, wait_s=30.0)
    except Interrupted:
        _stop_all(procs)
        raise
