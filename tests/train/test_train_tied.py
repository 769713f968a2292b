"""Tied input/output embeddings under pipeline parallelism in ``megatron-slim train``: the first
stage's word embedding and the last stage's output copy must each get the sum of both gradients
(Megatron all-reduces them over its embedding group) and be counted once in the gradient norm, so
the pipelined, sliced run trains exactly the model an unpipelined run trains."""

import pytest

from tests.oracle.reference import UNPIPELINED_UNSLICED
from tests.train.test_train_job import _train

pytestmark = pytest.mark.multi  # train runs on their ranks

TIED = [
    "model.untie_embeddings_and_output_weights=false",
    "train.iters=4",
    "train.global_batch_size=4",
    "model.seq_length=128",
    "train.warmup_iters=1",
    "train.lr=1e-2",
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_cache):
    return _train(tmp_path_factory.mktemp("tied"), "pp1", data_cache, *TIED, *UNPIPELINED_UNSLICED)


PIPELINED = {
    "pp2-slimpipe": ["parallel.pp=2", "schedule.kind=slimpipe", "schedule.num_slices=4"],
    "pp4-slimpipe": ["parallel.pp=4", "schedule.kind=slimpipe", "schedule.num_slices=4"],
    "tp2-pp2-slimpipe": ["parallel.tp=2", "parallel.pp=2", "schedule.kind=slimpipe", "schedule.num_slices=4"],
    "pp2-vpp2-interleaved": ["parallel.pp=2", "parallel.vpp=2", "schedule.kind=interleaved", "schedule.num_slices=1"],
}


# default-tier time: pp4 and tp2 tied runs go to the slow tier (pp2 and interleaved stay; tied pp4 is
# also checked by tests/runtime/pipeline/test_vocab_parallel_exactness.py, tp2 x pp2 by real_megatron)
SLOW_CASES = ("pp4-slimpipe", "tp2-pp2-slimpipe")


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_CASES else c for c in PIPELINED])
def test_tied_embeddings_with_slices_train_the_unpipelined_model(tmp_path, data_cache, reference, case):
    run = _train(tmp_path, case, data_cache, *TIED, *PIPELINED[case])
    assert run["loss_iterations"] == reference["loss_iterations"] == [1, 2, 3, 4]
    assert run["skipped_steps"] == 0
    assert run["losses"] == pytest.approx(reference["losses"], rel=1e-6, abs=0)
    assert reference["losses"][-1] < reference["losses"][0] - 0.05  # the updates are large enough to tell
