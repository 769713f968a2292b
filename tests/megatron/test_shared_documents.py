"""``--slimpipe-packing``'s document hand-over (``megatron/slimpipe/stage.shared_documents``) on a
tp2 x pp3 grid of gloo ranks, laid out as Megatron does (TP ranks adjacent): only TP rank 0 of the
first and last stages reads batches, yet every rank gets the first stage's document lengths, and
each reading rank replays exactly the batches it read."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from megatron_slim.runtime.spawn import run_ranks

TP, PP = 2, 3
SEQ = 64
FIRST = [{"tokens": 0, "document_lengths": (5, 59)}, {"tokens": 1}, {"tokens": 2, "document_lengths": (64,)}]


def _window(i: int, lengths) -> dict:
    import torch

    batch = {"tokens": torch.full((1, SEQ), i)}
    if lengths is not None:
        batch["document_lengths"] = lengths
    return batch


def _hand_over(rank, world_size):
    from megatron_slim.megatron.slimpipe.stage import shared_documents

    tp_groups = [dist.new_group([s * TP + t for t in range(TP)]) for s in range(PP)]
    pp_groups = [dist.new_group([s * TP + t for s in range(PP)]) for t in range(TP)]
    stage, tp_rank = divmod(rank, TP)
    reads = tp_rank == 0 and stage in (0, PP - 1)
    source = iter([_window(b["tokens"] + 10 * stage, b.get("document_lengths")) for b in FIRST]) if reads else None
    replay, lengths = shared_documents(source, len(FIRST), SEQ, pp_groups[tp_rank], tp_groups[stage], "cpu")
    replayed = [int(b["tokens"][0, 0]) for b in replay] if replay is not None else None
    return lengths, replayed


@pytest.mark.slow  # default-tier time: tests/runtime/pipeline/test_stage_lengths.py's pp x tp grid covers the hand-over
def test_every_rank_of_a_tp2_x_pp3_grid_gets_the_first_stages_documents():
    results = run_ranks(_hand_over, TP * PP, timeout_s=300)
    expected = [(5, 59), None, (64,)]
    for rank, (lengths, replayed) in enumerate(results):
        stage, tp_rank = divmod(rank, TP)
        assert lengths == expected, rank
        reads = tp_rank == 0 and stage in (0, PP - 1)
        assert replayed == ([10 * stage, 10 * stage + 1, 10 * stage + 2] if reads else None), rank
