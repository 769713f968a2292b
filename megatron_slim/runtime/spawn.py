"""Run a function on N local ranks joined by torch.distributed (gloo on CPU).

Used by ``megatron-slim train`` to launch its own ranks and by the multi-process tests. A failure
on any rank raises in the parent with that rank's traceback; no rank is left hanging.
"""
from __future__ import annotations

import os
import pickle
import queue as queue_module
import time
import socket
import traceback
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RankFailed(RuntimeError):
    """A spawned rank raised; the message holds its traceback."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, backend: str, threads: int, timeout_s: float,
            fn: Callable, args: tuple, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(threads)
    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        result = fn(rank, world_size, *args)
        queue.put((rank, True, pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - report anything to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable, world_size: int, *args: Any, backend: str = "gloo",
              threads_per_rank: int = 1, timeout_s: Optional[float] = 600.0,
              collective_timeout_s: float = 600.0) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes; return results by rank.

    ``fn`` must be importable (module level) and its result picklable. ``timeout_s`` bounds the
    whole run (None: no bound); ``collective_timeout_s`` bounds any one collective on a rank. A
    rank that raises, or dies without a result, fails the run at once and the others are stopped.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, backend, threads_per_rank,
                                               collective_timeout_s, fn, args, queue), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failure = None
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while len(results) < world_size and failure is None:
            try:
                rank, ok, payload = queue.get(timeout=2.0)
            except queue_module.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in results]
                if dead:
                    failure = f"rank(s) {dead} died (exit codes {[procs[i].exitcode for i in dead]}) without a result"
                elif deadline is not None and time.monotonic() > deadline:
                    failure = f"ranks {sorted(set(range(world_size)) - set(results))} produced no result within {timeout_s:.0f}s"
                continue
            if ok:
                results[rank] = pickle.loads(payload)
            else:
                failure = f"rank {rank} failed:\n{payload}"
    finally:
        for p in procs:
            if failure is not None and p.is_alive():
                p.terminate()
            p.join(timeout=30)
    if failure is not None:
        raise RankFailed(failure)
    return [results[r] for r in range(world_size)]
