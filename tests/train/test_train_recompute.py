"""Recomputation and activation offloading in ``megatron-slim train`` (pp=2, SlimPipe with 2
slices; and pp2 x cp2 on packed windows, SlimPipe's query-out CP attention, 4 slices): every
iteration's loss equals, bit for bit, that of the run without them, so each update used the same
gradients; offloading moves activations off the meter and lowers its peak. Context exchange under
CP with recomputation: ``test_train_exchange_cp.py``."""

import pytest

from tests.train.test_train_job import _train

pytestmark = pytest.mark.multi  # train runs on their ranks

SMALL = [
    "parallel.pp=2",
    "schedule.kind=slimpipe",
    "schedule.num_slices=2",
    "model.num_layers=4",
    "model.seq_length=128",
    "train.iters=3",
    "train.global_batch_size=4",
    "train.warmup_iters=1",
    "train.lr=1e-2",
]
VARIANTS = {
    "full-block-1-offload-0.5": ["train.recompute=full", "train.recompute_method=block", "train.offload_ratio=0.5"],
    "full-uniform-2": ["train.recompute=full", "train.recompute_method=uniform", "train.recompute_num_layers=2"],
    "selective-core_attn-mlp": ["train.recompute=selective", "train.recompute_modules=core_attn,mlp"],
}


# pp2 x cp2: packed windows of short documents run SlimPipe's query-out CP attention (no cp.engine)
CP_SMALL = [*SMALL, "parallel.cp=2", "data.packing=slimpack", "schedule.num_slices=4"]
CP_VARIANTS = {
    "cp2-full-block-1-offload-0.5": VARIANTS["full-block-1-offload-0.5"],
    "cp2-full-uniform-2": VARIANTS["full-uniform-2"],
    "cp2-selective-core_attn-mlp": VARIANTS["selective-core_attn-mlp"],
}
QUERY_OUT_CP = {"size": 2, "engine": None, "attention": "slimpipe-query-out", "document_masking": True}
# Every CP variant is in the slow tier: the default tier checks recomputation and offload under
# query-out CP against the reference in the runtime
# (tests/runtime/pipeline/test_slimpipe_cp_recompute.py), and through train without CP above.


@pytest.fixture(scope="module")
def plain(tmp_path_factory, data_cache):
    return _train(tmp_path_factory.mktemp("plain"), "plain", data_cache, *SMALL)


# default tier: one variant (block recomputation beside offload); each recomputation mode is exact
# against the reference in tests/runtime/pipeline/test_slimpipe_recompute.py
@pytest.mark.parametrize(
    "case", [c if c == "full-block-1-offload-0.5" else pytest.param(c, marks=pytest.mark.slow) for c in VARIANTS]
)
def test_recompute_and_offload_train_exactly_the_same_model(tmp_path, data_cache, plain, case):
    run = _train(tmp_path, case, data_cache, *SMALL, *VARIANTS[case])
    assert run["loss_iterations"] == plain["loss_iterations"] == [1, 2, 3]
    assert run["losses"] == plain["losses"]  # bit-exact: the same sums in the same order
    assert len(set(plain["losses"])) == 3  # every update changed the model
    for stage, base in zip(run["stages"], plain["stages"]):
        assert base["offloaded_bytes"] == 0
        assert stage["peak_activation_bytes"] < base["peak_activation_bytes"]
        assert (stage["offloaded_bytes"] > 0) == ("offload" in case)


@pytest.fixture(scope="module")
def plain_cp(tmp_path_factory, data_cache, short_documents):
    return _train(
        tmp_path_factory.mktemp("plain-cp"), "plain-cp", data_cache, *CP_SMALL, f"data.corpus={short_documents}"
    )


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CP_VARIANTS))
def test_recompute_and_offload_under_query_out_cp_train_exactly_the_same_model(
    tmp_path, data_cache, short_documents, plain_cp, case
):
    run = _train(tmp_path, case, data_cache, *CP_SMALL, f"data.corpus={short_documents}", *CP_VARIANTS[case])
    assert run["cp"] == plain_cp["cp"] == QUERY_OUT_CP
    assert run["losses"] == plain_cp["losses"] and len(set(plain_cp["losses"])) == 3
    for stage, base in zip(run["stages"], plain_cp["stages"]):
        assert base["offloaded_bytes"] == 0
        assert stage["peak_activation_bytes"] < base["peak_activation_bytes"]
        assert (stage["offloaded_bytes"] > 0) == ("offload" in case)


@pytest.mark.slow
def test_recompute_under_query_out_cp_with_two_model_chunks_trains_alike(tmp_path, data_cache, short_documents):
    """pp2 x vpp2 x cp2: a recomputed slice of either model chunk reads that chunk's cached K/V prefix
    on its CP rank; full and selective recomputation train bit for bit as the run without."""
    sets = [*CP_SMALL, "parallel.vpp=2", f"data.corpus={short_documents}"]
    plain = _train(tmp_path, "plain-vpp2", data_cache, *sets)
    full_uniform_1 = ["train.recompute=full", "train.recompute_method=uniform", "train.recompute_num_layers=1"]
    for case, recompute in {"full-uniform-1": full_uniform_1, "selective": VARIANTS["selective-core_attn-mlp"]}.items():
        run = _train(tmp_path, f"vpp2-{case}", data_cache, *sets, *recompute)
        assert run["cp"] == plain["cp"] == QUERY_OUT_CP
        assert run["losses"] == plain["losses"] and len(set(plain["losses"])) == 3, case
