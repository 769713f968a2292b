"""The group context-exchange messages travel on (``megatron/slimpipe/exchange_group.py``): the
pipeline group itself under gloo; its own group over the same ranks elsewhere (NCCL matches by
posting order). The separate group is made collectively by every rank, for every pipeline group;
checked here on 4 gloo ranks with two pipelines (ranks 0-1 and 2-3) by asking for it explicitly.
The served blocks' CP group (``exchange_cp_group``) is a second group over a CP group's ranks on
every backend, gloo included (checked with the same rank sets standing for CP groups)."""

import torch
import torch.distributed as dist

from megatron_slim.megatron.slimpipe.exchange_group import exchange_cp_group, exchange_group
from megatron_slim.runtime.nccl_rules import tags_keep_messages_apart
from megatron_slim.runtime.spawn import run_ranks

PIPELINES = ([0, 1], [2, 3])


def _worker(rank: int, world_size: int) -> tuple:
    groups = [dist.new_group(ranks) for ranks in PIPELINES]
    mine = groups[rank // 2]
    separate = exchange_group(mine, separate=True)
    again = exchange_group(mine, separate=True)
    other = PIPELINES[rank // 2][1 - rank % 2]
    sent = torch.full((3,), float(rank))
    got = torch.empty(3)
    ops = [dist.P2POp(dist.isend, sent, other, separate, 7), dist.P2POp(dist.irecv, got, other, separate, 7)]
    for work in dist.batch_isend_irecv(ops):  # one batch: NCCL's order for a crossed pair
        work.wait()
    cp = exchange_cp_group(mine)
    total = torch.tensor([float(rank)])
    dist.all_reduce(total, group=cp)
    return (
        cp is not mine and cp is not separate and exchange_cp_group(mine) is cp,
        dist.get_process_group_ranks(cp),
        total.item(),
        # gloo: the pipeline group itself (unless runtime/nccl_rules makes gloo match as NCCL does)
        (exchange_group(mine) is mine) == tags_keep_messages_apart(mine),
        separate is not mine and again is separate,
        dist.get_process_group_ranks(separate),
        got.tolist(),
    )


def test_a_separate_exchange_group_spans_each_pipelines_ranks_and_carries_messages():
    results = run_ranks(_worker, 4, timeout_s=120)
    for rank, (cp_own, cp_ranks, total, same, made_once, ranks, got) in enumerate(results):
        other = PIPELINES[rank // 2][1 - rank % 2]
        assert cp_own and cp_ranks == PIPELINES[rank // 2] and total == float(sum(PIPELINES[rank // 2]))
        assert same and made_once
        assert ranks == PIPELINES[rank // 2]
        assert got == [float(other)] * 3
