import random

import pytest

from megatron_slim.plan.cp.engines import plan_pack
from megatron_slim.plan.cp.remap import plan_remap, plan_remap_for

from .conftest import TOPOLOGIES, packs, topology


def random_counts(rng: random.Random, ranks: int) -> tuple[int, ...]:
    style = rng.choice(["skew", "uniform", "zeros", "one"])
    if style == "one":
        counts = [0] * ranks
        counts[rng.randrange(ranks)] = rng.randint(1, 5000)
        return tuple(counts)
    hi = 5000 if style != "uniform" else 10
    return tuple(rng.randint(0, hi) if style != "zeros" or rng.random() < 0.5 else 0 for _ in range(ranks))


def check_remap(counts, topo, plan):
    n = len(counts)
    total = sum(counts)
    assert sum(plan.target_tokens) == total and max(plan.target_tokens) - min(plan.target_tokens) <= 1
    surplus = sum(max(0, c - t) for c, t in zip(counts, plan.target_tokens))
    assert plan.moved_tokens == surplus  # nothing moves that need not
    senders = {t.src for t in plan.transfers}
    receivers = {t.dst for t in plan.transfers}
    assert not senders & receivers
    # source ranges: each sender ships exactly its tail beyond what it keeps, without overlap
    for r in range(n):
        spans = sorted((t.src_start, t.src_end) for t in plan.transfers if t.src == r)
        pos = plan.keep[r]
        for a, b in spans:
            assert a == pos and b > a
            pos = b
        assert pos == (counts[r] if r in senders else plan.keep[r])
        dst = sorted((t.dst_start, t.dst_end) for t in plan.transfers if t.dst == r)
        pos = plan.keep[r]
        for a, b in dst:
            assert a == pos and b > a
            pos = b
        assert pos == plan.target_tokens[r]
        assert plan.keep[r] == min(counts[r], plan.target_tokens[r])
    for t in plan.transfers:
        assert t.intra_node == topo.same_node(t.src, t.dst)
        assert t.dst_end - t.dst_start == t.tokens
    # intra-node first: no token leaves a node that still has an unfilled deficit, and none
    # enters a node that still had surplus to give inside itself
    for node in range(topo.num_nodes):
        ranks = topo.ranks_of_node(node)
        out_node = any(not t.intra_node and t.src in ranks for t in plan.transfers)
        in_node = any(not t.intra_node and t.dst in ranks for t in plan.transfers)
        node_surplus = sum(max(0, counts[r] - plan.target_tokens[r]) for r in ranks)
        node_deficit = sum(max(0, plan.target_tokens[r] - counts[r]) for r in ranks)
        assert not (out_node and in_node)
        if out_node:
            assert node_surplus > node_deficit
        if in_node:
            assert node_deficit > node_surplus
        inter = sum(t.tokens for t in plan.transfers if not t.intra_node and t.src in ranks)
        assert inter == max(0, node_surplus - node_deficit)


@pytest.mark.parametrize("name", sorted(TOPOLOGIES))
def test_remap_moves_only_surplus_intra_node_first(name):
    topo = topology(name)
    rng = random.Random(name)
    for _ in range(60):
        counts = random_counts(rng, topo.num_ranks)
        check_remap(counts, topo, plan_remap(counts, topo))


def test_inverse_moves_everything_back_and_round_trips_tokens():
    topo = topology("2x2")
    counts = (10, 0, 3, 7)
    plan = plan_remap(counts, topo)
    back = plan.inverse()
    assert back.source_tokens == plan.target_tokens and back.target_tokens == counts
    # follow each token: attention layout -> balanced -> attention layout
    where = {}
    for r, c in enumerate(counts):
        for k in range(c):
            where[(r, k)] = (r, k) if k < plan.keep[r] else None
    for t in plan.transfers:
        for k in range(t.tokens):
            where[(t.src, t.src_start + k)] = (t.dst, t.dst_start + k)
    assert sorted(where.values()) == sorted((r, k) for r, c in enumerate(plan.target_tokens) for k in range(c))
    home = {}
    for (r, k), (d, j) in where.items():
        if j < plan.keep[d] and d == r:
            home[(r, k)] = (d, j)
        else:
            (t,) = [t for t in back.transfers if t.src == d and t.src_start <= j < t.src_end]
            home[(r, k)] = (t.dst, t.dst_start + j - t.src_start)
    assert all(home[key] == key for key in home)
    assert sum(sum(row) for row in plan.send_counts()) == plan.moved_tokens


def test_balanced_input_moves_nothing():
    topo = topology("4x8")
    plan = plan_remap(tuple([100] * 32), topo)
    assert plan.transfers == () and plan.keep == tuple([100] * 32)


def test_remap_of_zeppelin_plans(costs):
    topo = topology("4x8")
    for lengths in packs(seed=3, count=6, total=100_000):
        plan = plan_pack("zeppelin", lengths, topo, costs)
        remap = plan_remap_for(plan, topo)
        check_remap(plan.tokens_per_rank(), topo, remap)
        assert remap.digest() == plan_remap_for(plan, topo).digest()
