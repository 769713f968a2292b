"""This process as one rank of a job that a launcher started: torchrun (``torch.distributed.run``),
``torch.distributed.launch``, or a cluster script that sets torchrun's variables.

:func:`launched_rank` reads the launcher's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHELASTIC_RUN_ID``) into a value, or
returns None when no launcher started this process; :func:`joined` initialises the default
process group from that environment (``env://``: under torchrun the ranks join the agent's store),
sets this rank's CPU threads and tears the group down afterwards. :func:`local_first` runs
something on local rank 0 of each node before the others (e.g. preparing a cache the others then
read). The own-spawn counterpart is :func:`megatron_slim.runtime.spawn.run_ranks`.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Iterator, Mapping, Optional, TypeVar, cast

from megatron_slim.plan.schema import ConfigError

T = TypeVar("T")
REQUIRED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class LaunchedRank:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    run_id: Optional[str] = None  # TORCHELASTIC_RUN_ID: set by torchrun only

    @property
    def launcher(self) -> str:
        return "torchrun" if self.run_id is not None else "a launcher"


def launched_rank(environ: Optional[Mapping[str, str]] = None) -> Optional[LaunchedRank]:
    """This process's place in a launched job, or None when nothing launched it as a rank.

    A process counts as launched when ``TORCHELASTIC_RUN_ID`` is set (torchrun) or when all of
    ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` are. A launched process with a
    missing or malformed variable fails with :class:`ConfigError` naming it.
    """
    env = os.environ if environ is None else environ
    run_id = env.get("TORCHELASTIC_RUN_ID")
    if run_id is None and not all(env.get(k) for k in REQUIRED):
        return None
    missing = [k for k in REQUIRED if not env.get(k)]
    if missing:
        raise ConfigError(
            f"{', '.join(missing)}: not set, but TORCHELASTIC_RUN_ID={run_id!r} says torchrun "
            f"started this process; allowed: run under torchrun, or unset TORCHELASTIC_RUN_ID"
        )

    def integer(name: str, default: Optional[int] = None, low: int = 0, high: Optional[int] = None) -> int:
        text = env.get(name)
        if text is None and default is not None:
            return default
        value: Optional[int]
        try:
            value = int(text) if text is not None else None
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            span = f">= {low}" if high is None else f"in {low}..{high}"
            raise ConfigError(f"{name}: not an integer {span} (got {text!r}); allowed: what torchrun sets")
        return value

    world_size = integer("WORLD_SIZE", low=1)
    rank = integer("RANK")
    local_rank = integer("LOCAL_RANK", default=rank)
    local_world_size = integer("LOCAL_WORLD_SIZE", default=world_size, low=1)
    if rank >= world_size or local_rank >= local_world_size:
        raise ConfigError(
            f"RANK={rank} LOCAL_RANK={local_rank}: outside WORLD_SIZE={world_size} / "
            f"LOCAL_WORLD_SIZE={local_world_size}; allowed: 0 <= RANK < WORLD_SIZE"
        )
    return LaunchedRank(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world_size,
        master_addr=env["MASTER_ADDR"],
        master_port=integer("MASTER_PORT", low=1, high=65535),
        run_id=run_id,
    )


def threads_per_rank(ranks_on_this_machine: int) -> int:
    """CPU threads for one of ``ranks_on_this_machine`` ranks: ``OMP_NUM_THREADS`` if set (torchrun
    sets 1 by default), else an equal share of the cores."""
    configured = os.environ.get("OMP_NUM_THREADS", "")
    if configured.isdigit() and int(configured) > 0:
        return int(configured)
    return max(1, (os.cpu_count() or 1) // max(1, ranks_on_this_machine))


@contextlib.contextmanager
def joined(job: LaunchedRank, backend: str = "gloo", timeout_s: float = 600.0) -> Iterator[None]:
    """Initialise the default process group from the launcher's environment for the block."""
    import torch
    import torch.distributed as dist

    from megatron_slim.runtime.nccl_rules import install_if_asked

    torch.set_num_threads(threads_per_rank(job.local_world_size))
    install_if_asked()
    try:
        dist.init_process_group(
            backend,
            init_method="env://",
            rank=job.rank,
            world_size=job.world_size,
            timeout=timedelta(seconds=timeout_s),
        )
    except dist.DistNetworkError as exc:  # e.g. rank 0 finds MASTER_PORT taken
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            f"MASTER_ADDR={job.master_addr} MASTER_PORT={job.master_port}: rank {job.rank} could not join the "
            f"rendezvous ({reason}); allowed: a free port on MASTER_ADDR, reachable from every rank"
        ) from None
    try:
        yield
    finally:
        dist.destroy_process_group()


def local_first(job: LaunchedRank, make: Callable[[], T], wait_s: float = 3600.0) -> T:
    """``make()`` on local rank 0 of each node first; the node's other ranks call it after a barrier.

    For builders of on-disk caches: local rank 0 builds, the others then find the entry built.
    The barrier waits up to ``wait_s`` (building may take longer than a collective timeout).
    A failure on local rank 0 raises there; the others then fail at the barrier.
    """
    import torch.distributed as dist

    # a group of its own so that the wait is not bounded by the default group's collective timeout
    patient = dist.new_group(timeout=timedelta(seconds=wait_s))
    try:
        result = make() if job.local_rank == 0 else None
        dist.barrier(group=patient)
    finally:
        dist.destroy_process_group(patient)
    return make() if job.local_rank != 0 else cast(T, result)
