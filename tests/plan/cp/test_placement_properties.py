"""Every engine's plan on many random packs and topologies: each (sequence, position) is held by
exactly one rank, position ids are offsets inside the sequence, groups are consistent, digests are
stable, and Zeppelin's per-rank load stays within a factor of the lower bound."""

import random

import pytest

from megatron_slim.plan.cp.choose import plan_zeppelin
from megatron_slim.plan.cp.engines import ENGINES, plan_pack
from megatron_slim.plan.cp.layout import SCOPE_PRIORITY
from megatron_slim.plan.cp.placement import partition_pack
from megatron_slim.plan.cp.topology import CPTopology
from megatron_slim.plan.schema import ConfigError

from .conftest import TOPOLOGIES, packs, topology


def check_plan(plan, lengths, topo):
    assert plan.lengths == tuple(lengths) and plan.num_ranks == topo.num_ranks
    held = {}
    for layout in plan.ranks:
        last_key = None
        for seg in layout.segments:
            assert 0 <= seg.start < seg.end <= lengths[seg.seq]
            assert seg.pack_start == plan.offsets[seg.seq] + seg.start
            assert list(seg.positions) == list(range(seg.start, seg.end))
            group = plan.groups[seg.group]
            assert layout.rank in group.ranks and seg.seq in group.seqs
            key = (group.priority, seg.group, group.seqs.index(seg.seq), seg.chunk, seg.part)
            assert last_key is None or key > last_key, "segments out of the documented order"
            last_key = key
            for p in seg.positions:
                assert (seg.seq, p) not in held, f"token {(seg.seq, p)} placed twice"
                held[(seg.seq, p)] = layout.rank
        assert layout.position_ids() == [p for s in layout.segments for p in s.positions]
    assert len(held) == sum(lengths), "some token is not placed"
    for group in plan.groups:
        assert group.scope == (
            "local"
            if len(group.ranks) == 1
            else "intra"
            if len({topo.node_of(r) for r in group.ranks}) == 1
            else "inter"
        )
        assert len(set(group.ranks)) == len(group.ranks)
        assert group.priority == SCOPE_PRIORITY[group.scope]
        if group.kind == "zigzag":
            assert group.ring_size == len(group.ranks)
        if group.kind == "hierarchical":
            a = group.a2a_size
            assert group.ring_size * a == len(group.ranks)
            for j in range(group.ring_size):  # one node per a2a block
                assert len({topo.node_of(r) for r in group.ranks[j * a : (j + 1) * a]}) == 1
    covered = sorted(i for g in plan.groups for i in g.seqs)
    assert covered == list(range(len(lengths)))
    assert [g.priority for g in plan.groups] == sorted(g.priority for g in plan.groups)


@pytest.mark.parametrize("name", sorted(TOPOLOGIES))
@pytest.mark.parametrize("engine", ENGINES)
def test_every_token_placed_exactly_once_with_its_position(engine, name, costs):
    topo = topology(name)
    if engine == "ulysses" and costs.heads % topo.num_ranks:
        with pytest.raises(ConfigError, match="parallel.cp=12"):
            plan_pack(engine, (5, 7), topo, costs)
        return
    for lengths in packs(seed=hash((engine, name)) % 1000, count=8, total=6000):
        plan = plan_pack(engine, lengths, topo, costs)
        check_plan(plan, lengths, topo)


def test_zigzag_members_hold_chunk_i_and_2g_minus_1_minus_i(costs):
    topo = topology("2x2")
    plan = plan_pack("ring", (13, 100, 3), topo, costs)
    (group,) = plan.groups
    for i, rank in enumerate(group.ranks):
        for seg in plan.ranks[rank].segments:
            assert seg.chunk in (i, 2 * len(group.ranks) - 1 - i)
    # 3 tokens over 8 chunks: most chunks empty, every token still placed once
    assert sum(s.length for r in plan.ranks for s in r.segments if s.seq == 2) == 3


def test_digest_is_stable_and_sensitive(costs):
    topo = topology("4x8")
    lengths = packs(seed=5, count=1, total=200_000)[0]
    a = plan_zeppelin(lengths, topo, costs)
    b = plan_zeppelin(tuple(lengths), topo, costs)
    assert a.digest() == b.digest() and len(a.digest()) == 64
    changed = list(lengths)
    changed[0], changed[-1] = changed[-1] + 1, changed[0] - 1 if changed[0] > 1 else changed[0]
    if sum(changed) == sum(lengths) and tuple(changed) != tuple(lengths):
        assert plan_zeppelin(tuple(changed), topo, costs).digest() != a.digest()
    assert plan_pack("ring", lengths, topo, costs).digest() != a.digest()
    other = CPTopology.uniform(2, 16)
    assert plan_zeppelin(lengths, other, costs).digest() != a.digest()


def test_distinct_packs_get_distinct_digests(costs):
    topo = topology("2x2")
    distinct = set(packs(seed=11, count=40, total=3000))
    assert len({plan_zeppelin(p, topo, costs).digest() for p in distinct}) == len(distinct) > 10


@pytest.mark.parametrize("name", ["1x4", "2x2", "4x8", "3x4"])
def test_zeppelin_rank_load_within_twice_the_lower_bound(name, costs):
    topo = topology(name)
    rng = random.Random(7)
    for lengths in packs(seed=rng.randint(0, 10**6), count=12, total=64_000):
        splits, members, loads = partition_pack(lengths, topo, costs)
        total = sum(sp.est_s * sp.span for sp in splits)
        piece = max(sp.est_s for sp in splits)
        bound = max(total / topo.num_ranks, piece)
        assert max(loads) <= 2 * bound + 1e-12
        for sp, ranks in zip(splits, members):
            assert len(ranks) == sp.span


def test_zeppelin_keeps_short_sequences_local_and_spreads_a_huge_one(costs):
    topo = topology("4x8")
    plan = plan_zeppelin((262144,), topo, costs)
    assert plan.groups[0].scope == "inter" and len(plan.groups[0].ranks) == 32
    tiny = plan_zeppelin(tuple([256] * 1024), topo, costs)
    assert {g.kind for g in tiny.groups} == {"local"}
    tokens = tiny.tokens_per_rank()
    assert max(tokens) - min(tokens) <= 256


def test_all_tiny_sequences_balance_tokens(costs):
    topo = topology("2x2")
    plan = plan_zeppelin(tuple([1] * 1001), topo, costs)
    tokens = plan.tokens_per_rank()
    assert sum(tokens) == 1001 and max(tokens) - min(tokens) <= 1


@pytest.mark.parametrize("engine", ["ulysses", "a2a+p2p"])
def test_head_parallel_engines_need_divisible_heads(engine, costs):
    topo = CPTopology.uniform(2, 3)  # 32 heads over 3 per node / 6 ranks
    with pytest.raises(ConfigError, match="num_attention_heads=32"):
        plan_pack(engine, (100, 200), topo, costs)


def test_invalid_lengths_and_topologies_are_rejected(costs):
    with pytest.raises(ConfigError, match=r"lengths\[1\]"):
        plan_zeppelin((5, 0), topology("2x2"), costs)
    with pytest.raises(ConfigError, match="parallel.cp"):
        CPTopology(12, 8, topology("2x2").nvlink, topology("2x2").nic)


def test_ring_neighbours_follow_ring_order_and_node_rails(costs):
    topo = topology("2x2")
    ring = plan_pack("ring", (40, 24), topo, costs).groups[0]
    assert ring.ring_neighbours(0) == (3, 1) and ring.ring_neighbours(3) == (2, 0)
    hier = plan_pack("a2a+p2p", (40, 24), topo, costs).groups[0]
    assert hier.kind == "hierarchical" and hier.ring_size == 2 and hier.a2a_size == 2
    assert hier.ring_neighbours(1) == (3, 3)  # local index 1 of node 0 <-> local index 1 of node 1
    assert {g.index for g in plan_pack("ring", (1,), topo, costs).groups_of(3)} == {0}  # holds no token


def one_token_packs(num_ranks: int) -> list[tuple[int, ...]]:
    """Packs made only of one-token documents: fewer tokens than ranks, exactly as many, a few
    more, and many (the windows a corpus of empty documents gives)."""
    return [(1,) * n for n in sorted({1, max(1, num_ranks - 1), num_ranks, 2 * num_ranks + 1, 257})]


@pytest.mark.parametrize("name", sorted(TOPOLOGIES))
@pytest.mark.parametrize("engine", ENGINES)
def test_one_token_only_packs_are_planned_by_every_engine(engine, name, costs):
    """Every engine accepts such a pack (none may refuse a window a dataset can produce); ranks left
    without tokens stay members of their engine's groups, so they take part in its collectives."""
    topo = topology(name)
    if engine == "ulysses" and costs.heads % topo.num_ranks:
        return  # refused before any work on head count (test above), whatever the pack
    for lengths in one_token_packs(topo.num_ranks):
        plan = plan_pack(engine, lengths, topo, costs)
        check_plan(plan, lengths, topo)
        assert sum(plan.tokens_per_rank()) == len(lengths)
        if engine in ("ring", "allgather", "a2a+p2p", "ulysses"):  # one group over every rank
            assert all(len(plan.groups_of(r)) == 1 for r in range(topo.num_ranks))
