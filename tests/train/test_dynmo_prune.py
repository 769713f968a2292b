"""Gradual magnitude pruning of FFN neurons (``dynmo.prune``) against the same rule applied by hand to
stock layers (masks on the weights before every forward and after every step)."""

import pytest
import torch

from megatron_slim.runtime.spawn import run_ranks
from tests.oracle.models import TINY_GQA_4L
from tests.train import _prune_workers

pytestmark = pytest.mark.multi
SEED = 11


@pytest.fixture(scope="module")
def pruning():
    return run_ranks(_prune_workers.pruning, 1, SEED)[0]


def test_pruned_run_equals_the_masks_applied_by_hand(pruning):
    fast, hand = pruning["fast"], pruning["hand"]
    assert fast["losses"] == pytest.approx(hand["losses"], rel=1e-5)
    assert fast["state"].keys() == hand["state"].keys()
    for name, value in fast["state"].items():
        torch.testing.assert_close(value, hand["state"][name], rtol=1e-4, atol=1e-6, msg=name)


def test_the_same_neurons_are_pruned_on_the_schedule(pruning):
    ffn = TINY_GQA_4L["ffn_hidden_size"]
    assert pruning["fast_pruned"] == pruning["hand_pruned"]
    assert all(len(p) == ffn // 2 for p in pruning["fast_pruned"])  # the final sparsity 0.5
    assert pruning["kept_share"] == {layer: 0.5 for layer in range(TINY_GQA_4L["num_layers"])}
    assert len(set(map(tuple, pruning["fast_pruned"]))) > 1  # chosen per layer by magnitude


def test_pruned_weights_and_gradients_stay_exactly_zero(pruning):
    assert pruning["pruned_grad_max"] == 0.0
    assert pruning["pruned_weight_max"] == 0.0  # after every optimizer step, moments and decay included
    for name, value in pruning["fast"]["state"].items():
        if name.endswith("mlp.linear_fc2.weight"):
            assert (value == 0).all(0).sum() == TINY_GQA_4L["ffn_hidden_size"] // 2, name


def test_the_compact_mlp_does_fewer_flops(pruning):
    """Per layer, the forward MLP drops 2*tokens*(3*h*pruned) FLOPs: gate, up and down matmuls."""
    m = TINY_GQA_4L
    tokens, pruned = 2 * m["seq_length"], m["ffn_hidden_size"] // 2
    saved = m["num_layers"] * 2 * tokens * 3 * m["hidden_size"] * pruned
    assert pruning["hand"]["flops"] - pruning["fast"]["flops"] == saved
