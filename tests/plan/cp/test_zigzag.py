import pytest

from megatron_slim.plan.cp.zigzag import (
    causal,
    chunk_bounds,
    hierarchical_ranges,
    member_prefix_pairs,
    member_ranges,
    step_pairs,
)
from megatron_slim.plan.sim.cp.ring import ring_pairs

LENGTHS = [1, 2, 3, 7, 8, 15, 16, 63, 64, 100, 1001, 4097]


@pytest.mark.parametrize("ring", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("length", LENGTHS)
def test_chunks_cover_the_sequence_and_steps_cover_every_causal_pair(length, ring):
    b = chunk_bounds(length, 2 * ring)
    sizes = [b[k + 1] - b[k] for k in range(2 * ring)]
    assert b[0] == 0 and b[-1] == length and max(sizes) - min(sizes) <= 1
    covered = sorted(p for i in range(ring) for _, a, z in member_ranges(length, ring, i) for p in range(a, z))
    assert covered == list(range(length))
    total = sum(step_pairs(length, ring, i, j) for i in range(ring) for j in range(ring))
    assert total == causal(length)
    assert sum(member_prefix_pairs(length, ring, i) for i in range(ring)) == causal(length)
    assert ring_pairs([length], ring) == [[step_pairs(length, ring, i, j) for j in range(ring)] for i in range(ring)]


@pytest.mark.parametrize("length,ring", [(64 * 1024, 8), (8 * 1000 + 3, 4), (999, 3)])
def test_zigzag_balances_causal_work_across_members(length, ring):
    work = [sum(step_pairs(length, ring, i, j) for j in range(ring)) for i in range(ring)]
    chunk = length / (2 * ring)
    assert max(work) - min(work) <= 4 * ring * (chunk + 1)  # rounding of uneven chunks only
    assert max(work) / min(work) < 1.01


@pytest.mark.parametrize("length", [5, 17, 1000, 4099])
def test_hierarchical_parts_cover_the_sequence(length):
    nodes, per_node = 3, 4
    covered = sorted(
        p
        for node in range(nodes)
        for local in range(per_node)
        for _, _, a, z in hierarchical_ranges(length, nodes, per_node, node, local)
        for p in range(a, z)
    )
    assert covered == list(range(length))
