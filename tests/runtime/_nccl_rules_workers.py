"""Scenarios for tests/runtime/test_nccl_rules.py: each on a fresh group of ranks 0 and 1, so one
scenario's broken channel never meets the next; each returns "ok" or the error it raised."""

import torch
import torch.distributed as dist

from megatron_slim.runtime import nccl_rules


def swapped_receives(me: int, group) -> str:
    """Rank 0 sends a (tag 1) then b (tag 2); rank 1 receives tag 2 first: gloo delivers by tag, NCCL by order."""
    a, b = torch.full((4,), 1.0), torch.full((4,), 2.0)
    if me == 0:
        works = [dist.isend(a, 1, group, tag=1), dist.isend(b, 1, group, tag=2)]
        for w in works:
            w.wait()
        return "ok"
    got_b, got_a = torch.zeros(4), torch.zeros(4)
    works = [dist.irecv(got_b, 0, group, tag=2), dist.irecv(got_a, 0, group, tag=1)]
    for w in works:
        w.wait()
    return "ok" if (got_a.tolist(), got_b.tolist()) == ([1.0] * 4, [2.0] * 4) else "wrong data"


def in_order(me: int, group) -> str:
    """Tags differ but both ends post in one order: NCCL delivers each where it belongs."""
    if me == 0:
        dist.send(torch.arange(3.0), 1, group, tag=7)
        dist.send(torch.arange(5.0), 1, group, tag=9)
        return "ok"
    first, second = torch.zeros(3), torch.zeros(5)
    dist.recv(first, 0, group, tag=7)
    dist.recv(second, 0, group, tag=9)
    return "ok" if second.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0] else "wrong data"


def size_mismatch(me: int, group) -> str:
    if me == 0:
        dist.send(torch.zeros(6), 1, group)
        return "ok"
    dist.recv(torch.zeros(6, dtype=torch.bfloat16), 0, group)
    return "ok"


def crossed_sends(me: int, group) -> str:
    """Both ranks send before they receive, each as its own operation: gloo buffers; NCCL deadlocks."""
    peer = 1 - me
    send = dist.isend(torch.full((8,), float(me)), peer, group)
    try:
        dist.recv(torch.zeros(8), peer, group)
    finally:
        send.wait()
    return "ok"


def crossed_receives(me: int, group) -> str:
    """Both ranks post their receive before their send: gloo matches them; on NCCL each receive runs
    first on its pair's stream and waits for a send queued behind the other's receive."""
    peer, got = 1 - me, torch.zeros(8)
    receive = dist.irecv(got, peer, group)
    send = dist.isend(torch.full((8,), float(me)), peer, group)
    try:
        receive.wait()
    finally:
        send.wait()
    return "ok"


def crossed_in_one_batch(me: int, group) -> str:
    """The same exchange as one batch_isend_irecv: NCCL runs it as one group."""
    peer, got = 1 - me, torch.zeros(8)
    ops = [dist.P2POp(dist.isend, torch.full((8,), float(me)), peer, group), dist.P2POp(dist.irecv, got, peer, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return "ok" if got.tolist() == [float(peer)] * 8 else "wrong data"


def ordered_by_parity(me: int, group) -> str:
    """Megatron's unbatched order: one rank sends first, the other receives first."""
    peer, got, mine = 1 - me, torch.zeros(8), torch.full((8,), float(me))
    if me == 0:
        dist.send(mine, peer, group)
        dist.recv(got, peer, group)
    else:
        dist.recv(got, peer, group)
        dist.send(mine, peer, group)
    return "ok" if got.tolist() == [float(peer)] * 8 else "wrong data"


def different_collectives(me: int, group) -> str:
    t = torch.ones(4)
    if me == 0:
        dist.all_reduce(t, group=group)
    else:
        dist.broadcast(t, 0, group=group)
    return "ok"


def different_sizes(me: int, group) -> str:
    dist.all_reduce(torch.ones(4 + me), group=group)
    return "ok"


def uneven_all_to_all(me: int, group) -> str:
    """Rank 0 sends 1 row to rank 1, which expects 2."""
    sends = [[1, 1], [2, 1]][me]
    receives = [[1, 2], [2, 1]][me]
    out = torch.zeros(sum(receives), 3)
    dist.all_to_all_single(out, torch.ones(sum(sends), 3), receives, sends, group=group)
    return "ok"


def any_source(me: int, group) -> str:
    if me == 1:
        dist.recv(torch.zeros(2), None, group)
    return "ok"


SCENARIOS = (
    swapped_receives,
    in_order,
    size_mismatch,
    crossed_sends,
    crossed_receives,
    crossed_in_one_batch,
    ordered_by_parity,
    different_collectives,
    different_sizes,
    uneven_all_to_all,
    any_source,
)


def run_scenarios(rank: int, world_size: int, checked: bool, names: tuple[str, ...]) -> dict[str, str]:
    if checked:
        nccl_rules.install()
    results = {}
    for scenario in (s for s in SCENARIOS if s.__name__ in names):
        group = dist.new_group([0, 1])
        try:
            results[scenario.__name__] = scenario(rank, group)
        except nccl_rules.NcclRuleBroken as exc:
            results[scenario.__name__] = f"broken: {exc}"
    return results
