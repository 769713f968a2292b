"""Megatron's THD batches under SlimPipe through the real ``pretrain_gpt.py``: from core_v0.19,
``--dataloader-inter-document-masking`` has ``GPTDataset`` put each window's document offsets in the
batch (``cu_seqlens``), from which ``get_batch`` would build ``PackedSeqParams``. Under
``--use-slimpipe`` the slicing data iterator takes them as the window's documents and the slices run
per-document attention through the K/V cache (``runtime/pipeline/sliced_data.py``).

Compared with Megatron's own pp2 1F1B run on the same data that attends within each document through
its block mask (``--reset-position-ids --reset-attention-mask``; every corpus document ends in eod,
so both see the same boundaries): same losses and gradient norms. Slicing across documents without
their boundaries would change every loss from iteration 1.
"""

from __future__ import annotations

import pytest

from tests.real_megatron.harness import (
    TINY,
    installed_megatron_core,
    megatron_args,
    relative_difference,
    run_pretrain,
    write_corpus,
)

pytestmark = pytest.mark.real_megatron
TOLERANCE = 1e-5


@pytest.mark.skipif(installed_megatron_core() < (0, 19), reason="--dataloader-inter-document-masking: core_v0.19+")
def test_inter_document_masking_windows_train_under_slimpipe_as_megatrons_masked_run(tmp_path):
    corpus = write_corpus(tmp_path / "docs")
    common = [*TINY, "parallel.pp=2"]
    ours = megatron_args([*common, "schedule.kind=slimpipe", "schedule.num_slices=4"])
    ours += ["--dataloader-inter-document-masking"]
    reference = megatron_args([*common, "schedule.kind=1f1b", "schedule.num_slices=1"])
    reference = [f for f in reference if f != "--no-create-attention-mask-in-dataloader"]
    reference += ["--reset-position-ids", "--reset-attention-mask"]

    sliced = run_pretrain(2, ours, tmp_path / "ours", launcher=True, data_prefix=corpus)
    megatron = run_pretrain(2, reference, tmp_path / "reference", launcher=False, data_prefix=corpus)

    assert len(megatron.losses) == 3 and sliced.skipped == megatron.skipped == 0
    assert megatron.losses[-1] < megatron.losses[0]  # it trained
    assert relative_difference(sliced.losses, megatron.losses) <= TOLERANCE, (sliced.losses, megatron.losses)
    assert relative_difference(sliced.grad_norms, megatron.grad_norms) <= TOLERANCE, (
        sliced.grad_norms,
        megatron.grad_norms,
    )
