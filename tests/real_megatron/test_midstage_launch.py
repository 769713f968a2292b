"""Middle pipeline stages under the real ``pretrain_gpt.py``: they read no batch, so the first stage
hands them each microbatch's lengths (``runtime/pipeline/stage_lengths``).

(a) ``--slimpipe-packing`` at pp4 against the same packed run at pp2, where both stages read the
batch themselves. Megatron seeds each pipeline rank differently, so the shim's ``init_by_name``
draws every weight from its global name: both splits start from the same model and see the same
windows (the packing plan does not depend on pp). A middle stage that attended across documents, or
restarted no RoPE position, would change every loss from iteration 1. (From core_v0.19 the model is
built through ``GPTModelBuilder``, which the shim wraps as well.)

(b) a CP engine (Zeppelin with its remap layer) at pp2 x cp2 through Megatron's own 1F1B, whose
stage-to-stage tensors then change shape per microbatch (each plan gives a CP rank its own token
count), against Megatron's own pp2 run without context parallelism that attends within each
document (``--reset-position-ids --reset-attention-mask``) on the same data. From megatron-core
0.18 the last stage gets no tokens from ``get_batch``, so it plans from the first stage's lengths too.
"""

from __future__ import annotations

import pytest

from tests.real_megatron.harness import TINY, megatron_args, relative_difference, run_pretrain, write_corpus

pytestmark = pytest.mark.real_megatron
TOLERANCE = 1e-5
BY_NAME = {"MEGATRON_SLIM_TEST_INIT_BY_NAME": "1"}


def _packing_flags(pp: int) -> list[str]:
    layout = [f"parallel.pp={pp}", "parallel.dp=1", "schedule.kind=slimpipe", "schedule.num_slices=2"]
    packing = ["--slimpipe-packing", "slimpack", "--calculate-per-token-loss"]
    return megatron_args([*TINY, *layout, "train.iters=4"]) + packing


def test_packed_windows_at_pp4_train_as_at_pp2(tmp_path):
    corpus = write_corpus(tmp_path / "docs")
    runs = {
        pp: run_pretrain(pp, _packing_flags(pp), tmp_path / f"pp{pp}", launcher=True, data_prefix=corpus, env=BY_NAME)
        for pp in (2, 4)
    }
    two, four = runs[2], runs[4]
    assert len(four.losses) == 4 and four.skipped == two.skipped == 0
    assert four.losses[-1] < four.losses[0] - 0.1, four.losses  # it trains
    assert relative_difference(four.losses, two.losses) <= TOLERANCE, (four.losses, two.losses)
    assert relative_difference(four.grad_norms, two.grad_norms) <= TOLERANCE, (four.grad_norms, two.grad_norms)


def test_a_cp_engine_at_pp2_x_cp2_trains_as_megatrons_own_pp2_run(tmp_path):
    corpus = write_corpus(tmp_path / "docs")
    common = [*TINY, "parallel.pp=2", "schedule.kind=1f1b", "schedule.num_slices=1"]
    ours = megatron_args([*common, "parallel.cp=2", "cp.engine=zeppelin", "cp.remap=true"])
    reference = [f for f in megatron_args(common) if f != "--no-create-attention-mask-in-dataloader"]
    reference += ["--reset-position-ids", "--reset-attention-mask"]

    engine = run_pretrain(4, ours, tmp_path / "ours", launcher=True, data_prefix=corpus)
    megatron = run_pretrain(2, reference, tmp_path / "reference", launcher=False, data_prefix=corpus)

    assert "megatron-slim: --cp-engine zeppelin --cp-remap" in engine.log
    assert "megatron-slim: " not in megatron.log
    assert len(megatron.losses) == 3 and engine.skipped == megatron.skipped == 0
    assert megatron.losses[-1] < megatron.losses[0]  # it trained
    assert relative_difference(engine.losses, megatron.losses) <= TOLERANCE, (engine.losses, megatron.losses)
    assert relative_difference(engine.grad_norms, megatron.grad_norms) <= TOLERANCE, (
        engine.grad_norms,
        megatron.grad_norms,
    )


def test_a_cp_engine_at_pp2_x_cp2_x_tp2_trains_as_megatrons_own_pp2_x_tp2_run(tmp_path):
    """TP rank 1 of the first stage reads no batch, and the last stage's TP rank 1 (from megatron-core
    0.18 every last-stage rank) gets no tokens: every rank plans from stage 0's TP rank 0 lengths."""
    corpus = write_corpus(tmp_path / "docs")
    common = [*TINY, "parallel.pp=2", "parallel.tp=2", "schedule.kind=1f1b", "schedule.num_slices=1"]
    ours = megatron_args([*common, "parallel.cp=2", "cp.engine=zeppelin"])
    reference = [f for f in megatron_args(common) if f != "--no-create-attention-mask-in-dataloader"]
    reference += ["--reset-position-ids", "--reset-attention-mask"]

    engine = run_pretrain(8, ours, tmp_path / "ours", launcher=True, data_prefix=corpus)
    megatron = run_pretrain(4, reference, tmp_path / "reference", launcher=False, data_prefix=corpus)

    assert "megatron-slim: --cp-engine zeppelin: CP attention" in engine.log
    assert len(megatron.losses) == 3 and engine.skipped == megatron.skipped == 0
    assert megatron.losses[-1] < megatron.losses[0]  # it trained
    assert relative_difference(engine.losses, megatron.losses) <= TOLERANCE, (engine.losses, megatron.losses)
    assert relative_difference(engine.grad_norms, megatron.grad_norms) <= TOLERANCE, (
        engine.grad_norms,
        megatron.grad_norms,
    )
