"""``schedule.slice_policy: exchange`` in ``megatron-slim train``: uniform slices with attention work
moved between pipeline ranks train exactly the model an unpipelined, unsliced run trains, and the
ranks report the K/V tokens they shipped (so the run cannot pass without exchanging)."""

import pytest

from tests.oracle.reference import UNPIPELINED_UNSLICED
from tests.train.test_train_job import _train

pytestmark = [pytest.mark.multi, pytest.mark.slow]  # train runs on their ranks (minutes)

COMMON = ["train.iters=3", "train.global_batch_size=4", "model.seq_length=128", "train.warmup_iters=1", "train.lr=1e-2"]
EXCHANGE = ["schedule.kind=slimpipe", "schedule.num_slices=4", "schedule.slice_policy=exchange"]


@pytest.mark.parametrize("pipeline", [["parallel.pp=4"], ["parallel.pp=2", "parallel.vpp=2"]], ids=["pp4", "pp2-vpp2"])
def test_exchange_trains_the_unpipelined_model(tmp_path, data_cache, pipeline):
    reference = _train(tmp_path, "reference", data_cache, *COMMON, *UNPIPELINED_UNSLICED)
    run = _train(tmp_path, "exchange", data_cache, *COMMON, *pipeline, *EXCHANGE)
    assert run["loss_iterations"] == reference["loss_iterations"] == [1, 2, 3]
    assert run["losses"] == pytest.approx(reference["losses"], rel=1e-6, abs=0)
    assert max(reference["losses"]) - min(reference["losses"]) > 0.02  # updates move the loss past the tolerance
    assert all(stage["exchanged_tokens"] > 0 for stage in run["stages"])  # group plans: every stage sends
