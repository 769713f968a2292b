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
