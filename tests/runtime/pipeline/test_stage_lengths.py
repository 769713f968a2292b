"""The first pipeline stage hands each microbatch's lengths to the others
(``runtime/pipeline/stage_lengths``): the wire form round-trips, the first stage replays exactly
what it read, and every rank of a pipeline group (also one that does not start at global rank 0)
gets the first stage's lengths."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from megatron_slim.runtime.pipeline.stage_lengths import decode_lengths, encode_lengths
from megatron_slim.runtime.spawn import run_ranks

CASES = [[], [None], [(64,)], [(3, 61), None, (1, 1, 62)], [None, None]]


@pytest.mark.parametrize("lengths", CASES, ids=str)
def test_the_wire_form_round_trips(lengths):
    words = encode_lengths(lengths)
    assert words[0] == len(lengths)
    assert len(words) == 1 + len(lengths) + sum(len(x or ()) for x in lengths)
    assert decode_lengths(words) == lengths


def test_the_wire_form_is_the_documented_one():
    assert encode_lengths([(3, 61), None, (64,)]) == [3, 2, 3, 61, 0, 1, 64]


@pytest.mark.parametrize(
    "words,message",
    [([], "empty word list"), ([2, 1, 5], "ends before microbatch 1"), ([1, 3, 5], "announces 3 lengths"),
     ([1, 1, 5, 7], "1 words after the last")],
)  # fmt: skip
def test_a_malformed_word_list_is_refused(words, message):
    with pytest.raises(ValueError, match=message):
        decode_lengths(words)


@pytest.mark.parametrize("bad", [(), (0, 64), (-1,)])
def test_lengths_must_be_positive(bad):
    with pytest.raises(ValueError, match="allowed: one or more positive integers"):
        encode_lengths([bad])


def _documents(batch):
    return batch["documents"]


def _share(rank, world_size):
    from megatron_slim.runtime.pipeline.stage_lengths import share_microbatch_lengths

    batches = [{"documents": (5, 59), "i": 0}, {"documents": None, "i": 1}, {"documents": (64,), "i": 2}]
    out = {}
    iterator = iter(batches) if rank == 0 else None
    replay, out["world"] = share_microbatch_lengths(iterator, 3, _documents, dist.group.WORLD)
    out["replayed"] = [b["i"] for b in replay] if rank == 0 else replay
    # a pipeline group of global ranks 1 and 2: its first stage is rank 1
    sub = dist.new_group([1, 2])
    if rank in (1, 2):
        mine = iter([{"documents": (rank, 64 - rank)}]) if rank == 1 else None
        _, out["sub"] = share_microbatch_lengths(mine, 1, _documents, sub)
    return out


def test_every_stage_gets_the_first_stages_lengths_and_it_replays_what_it_read():
    results = run_ranks(_share, 3, timeout_s=120)
    for r in results:
        assert r["world"] == [(5, 59), None, (64,)]
    assert results[0]["replayed"] == [0, 1, 2]
    assert results[1]["replayed"] is None and results[2]["replayed"] is None
    assert results[1]["sub"] == results[2]["sub"] == [(1, 63)]
    assert "sub" not in results[0]


def _grid(rank, world_size):
    """Global rank = pp_rank * 2 + tp_rank (pipeline groups {0, 2}, {1, 3}; TP groups {0, 1}, {2, 3}).
    Only pipeline stage 0's TP rank 0 (global 0) passes the lengths; the others pass decoys."""
    from megatron_slim.runtime.pipeline.stage_lengths import first_rank_lengths

    pipelines = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    tensors = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pp_group, tp_group = pipelines[rank % 2], tensors[rank // 2]
    own = [(7, 57), None] if rank == 0 else ([(rank, 64 - rank), None] if rank == 2 else None)
    return first_rank_lengths(own, pp_group, tp_group)


def test_every_rank_of_a_pipeline_x_tp_grid_gets_stage_0_tp_rank_0s_lengths():
    assert run_ranks(_grid, 4, timeout_s=120) == [[(7, 57), None]] * 4


def _read_on_grid(rank, world_size):
    """pp3 x tp2, global rank = pp_rank * 2 + tp_rank: only stage 0's TP rank 0 (global 0) has a data
    iterator, as under ``pretrain_gpt.py``; the last stage's TP rank 0 (global 4) keeps its own."""
    from megatron_slim.runtime.pipeline.stage_lengths import share_first_stage_lengths

    pipelines = [dist.new_group([0, 2, 4]), dist.new_group([1, 3, 5])]
    tensors = [dist.new_group([0, 1]), dist.new_group([2, 3]), dist.new_group([4, 5])]
    batches = [{"documents": (9, 55), "i": 0}, {"documents": None, "i": 1}]
    iterator = iter(batches) if rank == 0 else (iter(["last stage's own"]) if rank == 4 else None)
    replay, lengths = share_first_stage_lengths(iterator, 2, _documents, pipelines[rank % 2], tensors[rank // 2])
    return lengths, (None if replay is None else [b if rank else b["i"] for b in replay])


def test_stage_0_tp_rank_0_reads_and_every_rank_of_a_pp3_x_tp2_grid_gets_its_lengths():
    results = run_ranks(_read_on_grid, 6, timeout_s=180)
    assert [lengths for lengths, _ in results] == [[(9, 55), None]] * 6
    assert [replay for _, replay in results] == [[0, 1], None, None, None, ["last stage's own"], None]
