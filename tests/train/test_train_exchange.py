"""``schedule.slice_policy: exchange`` in ``megatron-slim train``: uniform slices with attention work
moved between pipeline ranks train exactly the model an unpipelined, unsliced run trains, and the
ranks report the K/V tokens they shipped (so the run cannot pass without exchanging)."""

import pytest

from tests.oracle.reference import UNPIPELINED_UNSLICED
from tests.train.test_train_job import _train

pytestmark = [pytest.mark.multi, pytest.mark.slow]  # train runs on their ranks (minutes)

COMMON = ["train.iters=3", "train.global_batch_size=4", "model.seq_length=128", "train.warmup_iters=1", "train.lr=1e-2"]
EXCHANGE_PP4 = ["parallel.pp=4", "schedule.kind=slimpipe", "schedule.num_slices=4", "schedule.slice_policy=exchange"]


def test_exchange_trains_the_unpipelined_model(tmp_path, data_cache):
    reference = _train(tmp_path, "reference", data_cache, *COMMON, *UNPIPELINED_UNSLICED)
    run = _train(tmp_path, "exchange", data_cache, *COMMON, *EXCHANGE_PP4)
    assert run["loss_iterations"] == reference["loss_iterations"] == [1, 2, 3]
    assert run["losses"] == pytest.approx(reference["losses"], rel=1e-6, abs=0)
    assert max(reference["losses"]) - min(reference["losses"]) > 0.02  # updates move the loss past the tolerance
    assert all(stage["exchanged_tokens"] > 0 for stage in run["stages"])
