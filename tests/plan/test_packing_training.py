"""What ``megatron-slim train`` packs per iteration (``plan/pack/training.py``): the same documents for
every method, long documents cut into ``seq_length`` samples, no sample cut across MicroPacks,
windows of exactly ``seq_length`` tokens covering every document token once."""

import random

import pytest

from megatron_slim.plan.pack.costs import SliceCosts
from megatron_slim.plan.pack.plan import MicroPack, PackingPlan, Piece
from megatron_slim.plan.pack.training import (
    Window,
    cut_samples,
    iteration_samples,
    pack_iteration,
    plan_samples,
)
from megatron_slim.plan.recipe import load_recipe
from megatron_slim.plan.schema import ConfigError

COSTS = SliceCosts(1e-6, 2e-11, 2e-6, 6e-11, 1000.0, 1e-8)
SEQ = 128


def _lengths(seed: int, count: int = 200) -> list[int]:
    rng = random.Random(seed)
    return [rng.choice([rng.randint(1, 60), rng.randint(60, 200), rng.randint(200, 700)]) for _ in range(count)]


def test_iterations_take_consecutive_samples_within_the_budget():
    lengths = [50, 70, 30, 400, 10, 10]
    assert iteration_samples(lengths, 128, 0) == [0, 1]  # 50+70; +30 would pass 128
    assert iteration_samples(lengths, 128, 1) == [2]  # 30; +400 would pass
    assert iteration_samples(lengths, 128, 2) == [3]  # one sample even over the budget
    assert iteration_samples(lengths, 128, 3) == [4, 5, 0]  # wraps around the corpus
    assert iteration_samples([5, 5], 100, 0) == [0, 1]  # never one sample twice in an iteration


def test_long_documents_are_cut_into_seq_length_samples():
    samples = cut_samples([1, 0], [5, 300], SEQ)
    assert [(s.document, s.offset, s.length, s.last) for s in samples] == [
        (1, 0, 128, False),
        (1, 128, 128, False),
        (1, 256, 44, True),
        (0, 0, 5, True),
    ]
    assert sum(s.loss_tokens for s in samples) == (300 - 1) + (5 - 1)


@pytest.mark.parametrize("method", ["slimpack", "megatron", "bfd"])
@pytest.mark.parametrize("dp", [1, 2, 3])
def test_windows_cover_every_document_token_once_and_keep_samples_whole(method, dp):
    lengths = _lengths(dp)
    corpus = cut_samples(range(len(lengths)), lengths, SEQ)
    taken = iteration_samples([s.length for s in corpus], 8 * SEQ, 2)
    assert 7 * SEQ < sum(corpus[i].length for i in taken) <= 8 * SEQ
    packed = pack_iteration(method, [corpus[i] for i in taken], COSTS, dp, SEQ)
    seen: dict[int, list[tuple[int, int]]] = {}
    for windows in packed.windows:
        for w in windows:
            assert sum(p.length for p in w.pieces) + w.padding == SEQ
            assert sum(w.document_lengths) == SEQ
            for p in w.pieces:
                s = packed.samples[p.sample]
                seen.setdefault(s.document, []).append((s.offset + p.start, p.length))
    want = sorted((corpus[i].document, corpus[i].offset, corpus[i].length) for i in taken)
    assert sorted((d, a, n) for d, spans in seen.items() for a, n in spans) == want
    # every sample in exactly one window, whole
    owners = [p.sample for ws in packed.windows for w in ws for p in w.pieces]
    assert sorted(owners) == list(range(len(packed.samples)))
    tokens = sum(n for _, _, n in want)
    assert packed.padding_share() == pytest.approx(1 - tokens / (SEQ * sum(len(ws) for ws in packed.windows)))
    assert packed.loss_tokens == tokens - sum(1 for d, a, n in want if a + n == lengths[d])


def test_document_lengths_join_a_samples_adjacent_pieces_and_end_with_padding():
    w = Window((Piece(3, 0, 10), Piece(3, 10, 5), Piece(1, 0, 7)), 2)
    assert w.document_lengths == (15, 7, 2)
    assert Window((Piece(0, 0, 4),), 0).document_lengths == (4,)


def test_a_plan_cutting_a_sample_across_micropacks_is_refused(monkeypatch):
    import megatron_slim.plan.pack.training as training

    def cutting(method, lengths, costs, dp, cap):
        packs = (MicroPack((Piece(0, 0, 2),), 0, 0, 0), MicroPack((Piece(0, 2, 2),), 0, 0, 0))
        return PackingPlan(method, tuple(lengths), cap, float("inf"), (packs,))

    monkeypatch.setattr(training, "plan_baseline", cutting)
    with pytest.raises(ConfigError, match="sample 0 is cut across MicroPacks"):
        plan_samples("megatron", cut_samples([0], [4], SEQ), COSTS, 1, SEQ)


def test_recipe_checks_packing_and_what_it_needs():
    assert load_recipe("tiny-cpu").data.packing == "none"
    assert load_recipe("tiny-cpu", ["data.packing=slimpack"]).data.packing == "slimpack"
    with pytest.raises(ConfigError, match="data.packing.*slimpack"):
        load_recipe("tiny-cpu", ["data.packing=lpt"])
    with pytest.raises(ConfigError, match="train.micro_batch_size.*data.packing=bfd"):
        load_recipe("tiny-cpu", ["data.packing=bfd", "train.micro_batch_size=2"])
    one_pack = ["schedule.kind=1f1b", "schedule.num_slices=1", "parallel.cp=2", "parallel.pp=2"]
    with pytest.raises(ConfigError, match="parallel.cp.*1 with data.packing=megatron and schedule.kind=1f1b"):
        load_recipe("tiny-cpu", ["data.packing=megatron", *one_pack])
    under_cp = load_recipe("tiny-cpu", ["data.packing=megatron", "parallel.cp=2", "parallel.pp=2"])
    assert under_cp.query_out_cp and under_cp.schedule.kind == "slimpipe"
