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
    import os

    env = {k: os.environ[k] for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return {**env, "sum": allreduce_rank(rank, world_size)}
