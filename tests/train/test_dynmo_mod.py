"""Mixture of depths (``dynmo.mod_capacity``) against the same rule on stock layers."""

import pytest
import torch

from megatron_slim.runtime.spawn import run_ranks
from tests.train import _mod_workers

pytestmark = pytest.mark.multi
SEED = 13


@pytest.fixture(scope="module")
def mod():
    return run_ranks(_mod_workers.mixture_of_depths, 1, SEED)[0]


def test_mixture_of_depths_layer_matches_the_rule_on_stock_layers(mod):
    fast, ref = mod["fast"], mod["reference"]
    torch.testing.assert_close(fast["losses"], ref["losses"], rtol=1e-6, atol=1e-6)
    names = [n for n in fast["grads"] if "mod_router" not in n]
    assert sorted(names) == sorted(ref["grads"])
    for name in names:
        torch.testing.assert_close(fast["grads"][name], ref["grads"][name], rtol=1e-5, atol=1e-7, msg=name)
    assert sorted(fast["router_grads"]) == [1, 3]  # every other layer routes
    for layer, grad in fast["router_grads"].items():
        torch.testing.assert_close(grad, ref["router_grads"][layer], rtol=1e-5, atol=1e-7)
        assert grad.abs().max() > 0  # the router is on the gradient path


def test_routing_changes_the_result(mod):
    assert not torch.allclose(mod["fast"]["losses"], mod["stock"]["losses"])
