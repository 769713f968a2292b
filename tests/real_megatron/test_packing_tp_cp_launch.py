"""``--slimpipe-packing`` under tensor parallelism through the real ``pretrain_gpt.py``.

Only TP rank 0 of a stage gets a data iterator, and Megatron's TP batch broadcast carries tensors
only; the SlimPipe schedule hands each window's ``document_lengths`` from TP rank 0 to the other TP
ranks (``megatron/slimpipe/stage.py``, ``runtime/pipeline/stage_lengths``). Independent check: the
tp2 run computes the same model on the same windows as the tp1 run, so every iteration's loss and
gradient norm must agree up to fp rounding. Megatron seeds TP ranks apart, so the shim's
``init_by_name`` draws each weight whole from its global name and cuts this TP rank's shard: both
start from the same weights. A TP rank that attended
across documents, or restarted no RoPE position, would change the loss from iteration 1 on; without
the hand-over the run stops (the slice attention refuses documents one TP rank lacks).
"""

from __future__ import annotations

import re

import pytest

from tests.real_megatron.harness import TINY, megatron_args, relative_difference, run_pretrain, write_corpus

pytestmark = pytest.mark.real_megatron
TOLERANCE = 1e-5
BY_NAME = {"MEGATRON_SLIM_TEST_INIT_BY_NAME": "1"}
SUMMARY = re.compile(r"megatron-slim: packing \w+: .* (\d+) document tokens, (\d+) loss tokens \(iteration 1\)")


def _flags(layout: list[str]) -> list[str]:
    common = ["parallel.pp=2", "parallel.dp=1", "schedule.kind=slimpipe", "schedule.num_slices=2", "train.iters=4"]
    ours = megatron_args([*TINY, *common, *layout])
    return ours + ["--slimpipe-packing", "slimpack", "--calculate-per-token-loss"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("docs") / "docs")


@pytest.fixture(scope="module")
def tp1(corpus, tmp_path_factory):
    return run_pretrain(2, _flags([]), tmp_path_factory.mktemp("tp1"), launcher=True, data_prefix=corpus, env=BY_NAME)


@pytest.mark.parametrize("layout", ["parallel.tp=2", "parallel.cp=2"])
def test_packed_windows_at_tp2_and_cp2_train_as_at_tp1(layout, corpus, tp1, tmp_path):
    two = run_pretrain(4, _flags([layout]), tmp_path / "run", launcher=True, data_prefix=corpus, env=BY_NAME)
    assert SUMMARY.search(two.log).groups() == SUMMARY.search(tp1.log).groups()  # the same documents
    assert len(two.losses) == 4 and two.skipped == tp1.skipped == 0
    assert two.losses[-1] < two.losses[0] - 0.1, two.losses  # it trains
    assert relative_difference(two.losses, tp1.losses) <= TOLERANCE, (two.losses, tp1.losses)
    assert relative_difference(two.grad_norms, tp1.grad_norms) <= TOLERANCE, (two.grad_norms, tp1.grad_norms)
