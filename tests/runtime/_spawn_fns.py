import os
import time

import torch
import torch.distributed as dist


def allreduce_rank(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def fail_on_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()
    return rank


def rendezvous_env(rank, world_size):
    env = {k: os.environ[k] for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return {**env, "sum": allreduce_rank(rank, world_size)}


def print_rank(rank, world_size):
    print(f"rank {rank} of {world_size} says hello", flush=True)
    return os.getppid(), os.environ.get("MEGATRON_SLIM_TEST_PROBE"), os.getcwd()


def write_pid_and_sleep(rank, world_size, folder):
    from pathlib import Path

    Path(folder, f"rank{rank}.pid").write_text(str(os.getpid()))
    time.sleep(600)


def killed_while_the_other_waits(rank, world_size):
    import signal

    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def stopped_while_the_other_waits(rank, world_size):
    import signal

    from megatron_slim.runtime.heartbeat import set_step

    set_step("the test's stop")
    if rank == 1:
        time.sleep(1.0)  # a few heartbeats first
        os.kill(os.getpid(), signal.SIGSTOP)
    dist.barrier()
