"""Packed iterations with Megatron's fixed microbatch count per DP rank (``plan/pack/fixed_windows``)."""

from __future__ import annotations

import random

import pytest

from megatron_slim.plan.pack.costs import SliceCosts
from megatron_slim.plan.pack.fixed_windows import FixedWindowPlanner
from megatron_slim.plan.pack.training import cut_samples

COSTS = SliceCosts(1e-6, 2e-11, 2e-6, 6e-11, 1000.0, 1e-8)
SEQ = 64


def _corpus(seed: int, count: int = 120):
    rng = random.Random(seed)
    lengths = [rng.choice([rng.randint(2, 20), rng.randint(20, 60), rng.randint(60, 150)]) for _ in range(count)]
    return lengths, cut_samples(range(count), lengths, SEQ)


@pytest.mark.parametrize("method", ["slimpack", "megatron", "bfd"])
@pytest.mark.parametrize("dp,per_rank", [(1, 4), (2, 2), (3, 1)])
def test_every_rank_gets_exactly_the_count_and_iterations_cover_the_corpus_in_order(method, dp, per_rank):
    lengths, samples = _corpus(dp * 10 + per_rank)
    planner = FixedWindowPlanner(method, samples, COSTS, dp, SEQ, per_rank)
    seen = []
    for k in range(12):
        packing = planner.iteration(k)
        assert [len(ws) for ws in packing.windows] == [per_rank] * dp
        for ws in packing.windows:
            for w in ws:
                assert sum(p.length for p in w.pieces) + w.padding == SEQ
        assert packing.document_tokens <= dp * per_rank * SEQ
        placed = sorted(p.sample for ws in packing.windows for w in ws for p in w.pieces)
        assert sorted(set(placed)) == list(range(len(packing.samples)))
        seen += list(packing.samples)
    # consecutive iterations take consecutive samples of the corpus order, wrapping around
    assert seen == [samples[i % len(samples)] for i in range(len(seen))]


def test_a_rank_without_micropacks_runs_all_padding_windows_without_loss_tokens():
    samples = cut_samples([0], [10], SEQ)  # one short document, two ranks, three windows each
    packing = FixedWindowPlanner("bfd", samples, COSTS, 2, SEQ, 3).iteration(0)
    flat = [w for ws in packing.windows for w in ws]
    assert len(flat) == 6
    assert sum(1 for w in flat if not w.pieces and w.padding == SEQ) == 5
    assert packing.loss_tokens == 9


def test_more_micropacks_than_windows_hand_samples_to_the_next_iteration():
    # three 40-token samples fit 2 windows of 64 by tokens (120 <= 128) but not by packing
    samples = cut_samples(range(3), [40, 40, 40], SEQ)
    planner = FixedWindowPlanner("megatron", samples, COSTS, 1, SEQ, 2)
    first, second = planner.iteration(0), planner.iteration(1)
    assert [s.document for s in first.samples] == [0, 1]
    assert [s.document for s in second.samples][0] == 2
    assert planner.iteration(0) == first  # replanned alike
