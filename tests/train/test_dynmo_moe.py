"""MoE layers (``dynmo.moe_experts``) against top-k routing written out by hand, their per-iteration
expert load, and the synthetic drift."""

import pytest
import torch

from megatron_slim.runtime.spawn import run_ranks
from tests.oracle.models import TINY_GQA_4L
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
