"""Rank function of the ``VocabHead.reduce_grads`` test (module level so spawn can import it)."""

import torch
import torch.distributed as dist

from megatron_slim.runtime.pipeline.vocab_weights import VocabHead

VOCAB, HIDDEN = 7, 2


def rank_grad(rank: int, rows: int) -> torch.Tensor:
    """Rank ``rank``'s own gradient of a copy with ``rows`` rows (distinct per rank and row)."""
    return (10.0**rank) * torch.arange(1, rows * HIDDEN + 1, dtype=torch.float32).view(rows, HIDDEN)


def reduce_copies(rank, world_size, sharded: bool, sum_owned_copies: bool):
    """Copies of a VOCAB x HIDDEN weight: owned on the first and last rank when whole (tied), on the
    last alone when ``sharded``; owned copies keep their gradient in ``main_grad`` as Megatron's DDP
    does, replicas in ``.grad``. Returns this rank's gradient after ``reduce_grads``."""
    ranks = list(range(world_size))
    owned = rank == world_size - 1 or (not sharded and rank == 0)
    rows = VOCAB if owned or not sharded else len(torch.tensor_split(torch.arange(VOCAB), world_size)[rank])
    weight = torch.nn.Parameter(torch.zeros(rows, HIDDEN))
    if owned:
        weight.main_grad = rank_grad(rank, rows)
    else:
        weight.grad = rank_grad(rank, rows)
    head = VocabHead(weight, owned, dist.group.WORLD, ranks, vocab_size=VOCAB, sharded=sharded)
    head.reduce_grads(sum_owned_copies=sum_owned_copies)
    assert weight.grad is None or not owned  # an owned copy's gradient stays in main_grad
    return (weight.main_grad if owned else weight.grad).clone()
