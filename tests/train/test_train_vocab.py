"""``schedule.vocab_parallel`` in ``megatron-slim train``: the output layer and loss on every
pipeline rank (the last stage's hidden states cut along the sequence, copies of the output weight
whose gradients are summed over the pipeline group) train exactly the model an unpipelined,
unsliced run trains, with untied and with tied embeddings, and with two model chunks per rank
(interleaved SlimPipe; slow: tests/runtime/pipeline/test_vocab_parallel_exactness.py covers the
exchange with two chunks per rank)."""

import pytest

from tests.oracle.reference import UNPIPELINED_UNSLICED
from tests.train.test_train_job import _train

pytestmark = [pytest.mark.multi, pytest.mark.slow]  # train runs on their ranks

COMMON = ["train.iters=3", "train.global_batch_size=4", "model.seq_length=128", "train.warmup_iters=1", "train.lr=1e-2"]
VOCAB_PP2 = ["parallel.pp=2", "schedule.kind=slimpipe", "schedule.num_slices=2", "schedule.vocab_parallel=true"]


@pytest.mark.parametrize(
    "tied,vpp",
    # all slow: the default tier checks the vocabulary on every rank exactly in the runtime
    # (tests/runtime/pipeline/test_vocab_parallel_exactness.py) and through train's step
    # (tests/train/test_train_cp_vocab.py)
    [pytest.param(False, 1), pytest.param(True, 1), pytest.param(False, 2)],
    ids=["untied", "tied", "untied-vpp2"],
)
def test_vocab_parallel_trains_the_unpipelined_model(tmp_path, data_cache, tied, vpp):
    embeddings = [f"model.untie_embeddings_and_output_weights={str(not tied).lower()}"]
    reference = _train(tmp_path, "reference", data_cache, *COMMON, *embeddings, *UNPIPELINED_UNSLICED)
    run = _train(tmp_path, "vocab", data_cache, *COMMON, *embeddings, *VOCAB_PP2, f"parallel.vpp={vpp}")
    assert run["loss_iterations"] == reference["loss_iterations"] == [1, 2, 3]
    assert run["losses"] == pytest.approx(reference["losses"], rel=1e-6, abs=0)
    assert (
        max(reference["losses"]) - min(reference["losses"]) > 0.02
    )  # the updates move the loss far more than the tolerance
