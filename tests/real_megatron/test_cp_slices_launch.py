"""SlimPipe slices that follow a CP engine's plan through the real ``pretrain_gpt.py``
(``megatron/slimpipe/engine_slices.py``, ``docs/cp-pipeline.md``).

pp2 x cp2 (4 ranks), ``--use-slimpipe`` with 2 slices of each 64-token window under ``--cp-engine
zeppelin`` and 4 under ``ulysses`` (windows of 4..48-token documents, so slice boundaries fall inside
documents): every iteration's loss and gradient norm equal Megatron's own pp2 run without context
parallelism that attends within each document (``--reset-position-ids --reset-attention-mask``) on the same
data, as ``test_midstage_launch.py`` compares the CP engine without slices. From megatron-core 0.18 the
last stage's ``get_batch`` keeps no tokens; every stage plans from the first stage's lengths.

Stages and TP ranks that read no batch take the first stage's (TP rank 0's) lengths
(``runtime/pipeline/stage_lengths.first_rank_lengths``): pp4 x cp2 (middle stages read nothing)
against Megatron's own pp2 run, both drawing every weight from its global name (Megatron seeds each
pipeline rank differently; ``shim/init_by_name.py``), and pp2 x cp2 x tp2 (TP rank 1 reads nothing)
against Megatron's own pp2 x tp2 run.
"""

from __future__ import annotations

import pytest

from tests.real_megatron.harness import TINY, megatron_args, relative_difference, run_pretrain, write_corpus

pytestmark = pytest.mark.real_megatron
TOLERANCE = 1e-5
BY_NAME = {"MEGATRON_SLIM_TEST_INIT_BY_NAME": "1"}


def _sliced(common: list[str], engine: str, slices: int) -> list[str]:
    layout = ["parallel.cp=2", "schedule.kind=slimpipe", f"schedule.num_slices={slices}", f"cp.engine={engine}"]
    return megatron_args([*common, *layout])


def _megatrons_own(common: list[str]) -> list[str]:
    """Megatron's 1F1B without context parallelism, attending within each document."""
    one_f_one_b = megatron_args([*common, "schedule.kind=1f1b", "schedule.num_slices=1"])
    flags = [f for f in one_f_one_b if f != "--no-create-attention-mask-in-dataloader"]
    return flags + ["--reset-position-ids", "--reset-attention-mask"]


def _assert_same_training(run, megatron) -> None:
    assert len(megatron.losses) == 3 and run.skipped == megatron.skipped == 0
    assert megatron.losses[-1] < megatron.losses[0]  # it trained
    assert relative_difference(run.losses, megatron.losses) <= TOLERANCE, (run.losses, megatron.losses)
    assert relative_difference(run.grad_norms, megatron.grad_norms) <= TOLERANCE, (
        run.grad_norms,
        megatron.grad_norms,
    )


@pytest.mark.parametrize("engine, slices", [("zeppelin", 2), ("ulysses", 4)])
def test_slimpipe_slices_under_a_cp_engine_train_as_megatrons_own_pp2_run(tmp_path, engine, slices):
    corpus = write_corpus(tmp_path / "docs")
    common = [*TINY, "parallel.pp=2"]
    ours = _sliced(common, engine, slices)
    assert ["--cp-engine", engine] == ours[ours.index("--cp-engine") : ours.index("--cp-engine") + 2]

    run = run_pretrain(4, ours, tmp_path / "ours", launcher=True, data_prefix=corpus)
    megatron = run_pretrain(2, _megatrons_own(common), tmp_path / "reference", launcher=False, data_prefix=corpus)

    assert f"{slices} uniform slice(s)" in run.log and f"following --cp-engine {engine}'s plan" in run.log
    _assert_same_training(run, megatron)


def test_middle_stages_plan_slices_from_the_first_stages_lengths_at_pp4(tmp_path):
    corpus = write_corpus(tmp_path / "docs")
    ours = _sliced([*TINY, "parallel.pp=4"], "zeppelin", 2)
    reference = _megatrons_own([*TINY, "parallel.pp=2"])

    run = run_pretrain(8, ours, tmp_path / "ours", launcher=True, data_prefix=corpus, env=BY_NAME)
    megatron = run_pretrain(2, reference, tmp_path / "reference", launcher=False, data_prefix=corpus, env=BY_NAME)

    assert "following --cp-engine zeppelin's plan" in run.log
    _assert_same_training(run, megatron)


def test_tp_ranks_without_batches_plan_slices_from_tp_rank_0s_lengths(tmp_path):
    corpus = write_corpus(tmp_path / "docs")
    common = [*TINY, "parallel.pp=2", "parallel.tp=2"]

    run = run_pretrain(8, _sliced(common, "zeppelin", 2), tmp_path / "ours", launcher=True, data_prefix=corpus)
    megatron = run_pretrain(4, _megatrons_own(common), tmp_path / "reference", launcher=False, data_prefix=corpus)

    assert "following --cp-engine zeppelin's plan" in run.log
    _assert_same_training(run, megatron)
