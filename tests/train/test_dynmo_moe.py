"""MoE layers (``dynmo.moe_experts``) against top-k routing written out by hand, their per-iteration
expert load, and the synthetic drift."""

import pytest
import torch

from megatron_slim.runtime.spawn import run_ranks
from tests.oracle.models import TINY_GQA_4L
from tests.overrides import once_per_key
from tests.train import _moe_workers

pytestmark = pytest.mark.multi
SEED = 17


@pytest.fixture(scope="module")
def moe():
    return run_ranks(_moe_workers.moe, 1, SEED)[0]


@pytest.mark.parametrize("iteration", [1, 6])
def test_moe_layers_match_routing_by_hand(moe, iteration):
    fast, ref = moe[iteration]["fast"], moe[iteration]["reference"]
    torch.testing.assert_close(fast["losses"], ref["losses"], rtol=1e-6, atol=1e-6)
    assert fast["grads"].keys() == ref["grads"].keys()
    for name, grad in fast["grads"].items():
        torch.testing.assert_close(grad, ref["grads"][name], rtol=1e-5, atol=1e-7, msg=name)
    assert any("mlp.router.weight" in n for n in fast["grads"])
    assert any("local_experts.3.linear_fc1" in n for n in moe["param_names"])


@pytest.mark.parametrize("iteration", [1, 6])
def test_expert_load_counts_every_routed_token(moe, iteration):
    load = moe[iteration]["load"]
    assert load == moe[iteration]["hand_load"]
    tokens = 2 * TINY_GQA_4L["seq_length"]
    assert sorted(load) == list(range(TINY_GQA_4L["num_layers"]))
    assert all(sum(counts) == _moe_workers.TOPK * tokens for counts in load.values())


def test_synthetic_drift_moves_the_load_to_the_last_experts(moe):
    tokens = 2 * TINY_GQA_4L["seq_length"]
    late = moe[6]["load"]
    assert all(counts[2] + counts[3] >= 1.8 * tokens for counts in late.values())  # bias [-5, -5/3, 5/3, 5]
    assert any(counts[0] + counts[1] > 0.2 * tokens for counts in moe[1]["load"].values())


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data_cache):
    """``megatron-slim train --dynmo-moe-experts 4 --dynmo-moe-drift 2``: pp=2 (sliced) and one process."""
    import json

    from megatron_slim.cli import main
    from tests.oracle.reference import UNPIPELINED_UNSLICED
    from tests.train.conftest import SMALL_DATA

    tmp, runs = tmp_path_factory.mktemp("moe"), {}
    sets = ("train.iters=3", "train.global_batch_size=2", "model.seq_length=128")
    flags = ("--dynmo-moe-experts", "4", "--dynmo-moe-topk", "1", "--dynmo-moe-drift", "2")
    for name, more in (
        ("pp2", ("parallel.pp=2", "schedule.kind=slimpipe", "schedule.num_slices=2")),
        ("pp1", UNPIPELINED_UNSLICED),
    ):
        out = tmp / f"{name}.json"
        argv = [
            "train",
            "--set",
            *once_per_key(f"data.cache_dir={data_cache}", *SMALL_DATA, *sets, *more),
            "--json",
            str(out),
            *flags,
        ]
        assert main(argv) == 0
        runs[name] = json.loads(out.read_text())
    return runs


@pytest.mark.slow  # default-tier time: the MoE layers are checked by hand above, the pipeline in test_dynmo_train.py
def test_pipelined_moe_run_reproduces_the_single_process_losses_and_load(trained):
    piped, whole = trained["pp2"], trained["pp1"]
    assert len(piped["losses"]) == 3
    assert piped["losses"] == pytest.approx(whole["losses"], rel=1e-6)
    load = piped["dynmo"]["expert_load"]
    assert load == whole["dynmo"]["expert_load"]
    assert sorted(load, key=int) == [str(i) for i in range(8)]  # tiny-cpu: 8 layers over both stages
    tokens = 2 * 128  # global batch 2 of 128 tokens, top-1
    for per_iteration in load.values():
        assert len(per_iteration) == 3 and all(sum(c) == tokens for c in per_iteration)
        assert per_iteration[2][3] > per_iteration[0][3]  # the drift moves load to the last expert
