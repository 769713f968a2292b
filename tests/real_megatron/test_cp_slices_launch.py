"""SlimPipe slices that follow a CP engine's plan through the real ``pretrain_gpt.py``
(``megatron/slimpipe/engine_slices.py``, ``docs/cp-pipeline.md``).

pp2 x cp2 (4 ranks), ``--use-slimpipe`` with 2 slices of each 64-token window under ``--cp-engine
zeppelin`` and 4 under ``ulysses`` (windows of 4..48-token documents, so slice boundaries fall inside
documents): every iteration's loss and gradient norm equal Megatron's own pp2 run without context
parallelism that attends within each document (``--reset-position-ids --reset-attention-mask``) on the same
data, as ``test_midstage_launch.py`` compares the CP engine without slices.
"""

from __future__ import annotations

import pytest

from tests.real_megatron.harness import TINY, megatron_args, relative_difference, run_pretrain, write_corpus

pytestmark = pytest.mark.real_megatron
TOLERANCE = 1e-5


@pytest.mark.parametrize("engine, slices", [("zeppelin", 2), ("ulysses", 4)])
def test_slimpipe_slices_under_a_cp_engine_train_as_megatrons_own_pp2_run(tmp_path, engine, slices):
    corpus = write_corpus(tmp_path / "docs")
    common = [*TINY, "parallel.pp=2"]
    sliced = [
        *common,
        "parallel.cp=2",
        "schedule.kind=slimpipe",
        f"schedule.num_slices={slices}",
        f"cp.engine={engine}",
    ]
    ours = megatron_args(sliced)
    assert ["--cp-engine", engine] == ours[ours.index("--cp-engine") : ours.index("--cp-engine") + 2]
    one_f_one_b = megatron_args([*common, "schedule.kind=1f1b", "schedule.num_slices=1"])
    reference = [f for f in one_f_one_b if f != "--no-create-attention-mask-in-dataloader"]
    reference += ["--reset-position-ids", "--reset-attention-mask"]

    run = run_pretrain(4, ours, tmp_path / "ours", launcher=True, data_prefix=corpus)
    megatron = run_pretrain(2, reference, tmp_path / "reference", launcher=False, data_prefix=corpus)

    assert f"{slices} uniform slice(s)" in run.log and f"following --cp-engine {engine}'s plan" in run.log
    assert len(megatron.losses) == 3 and run.skipped == megatron.skipped == 0
    assert megatron.losses[-1] < megatron.losses[0]  # it trained
    assert relative_difference(run.losses, megatron.losses) <= TOLERANCE, (run.losses, megatron.losses)
    assert relative_difference(run.grad_norms, megatron.grad_norms) <= TOLERANCE, (
        run.grad_norms,
        megatron.grad_norms,
    )
