"""The dynamic models of ``dynmo:`` on one rank: layer freezing on a schedule and early exit, each
against an independent statement of the same rule."""

import pytest
import torch

from megatron_slim.runtime.spawn import run_ranks
from tests.train import _dynmo_workers

pytestmark = pytest.mark.multi
SEED = 7


@pytest.fixture(scope="module")
def freezing():
    return run_ranks(_dynmo_workers.freezing, 1, SEED)[0]


@pytest.fixture(scope="module")
def early_exit():
    return run_ranks(_dynmo_workers.early_exit, 1, SEED)[0]


def _layer(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[2]) if name.startswith("decoder.layers.") else None


def test_frozen_layers_keep_their_weights_after_the_first_step(freezing):
    """Layers 0 and 2 train in step 1 and are frozen from step 2: their weights after step 3 are
    bit-identical to those after step 1 in the run frozen by hand, and differ from the initial ones."""
    for name, value in freezing["schedule"].items():
        if _layer(name) in _dynmo_workers.FROZEN:
            assert torch.equal(value, freezing["hand"][name]), name
            assert not torch.equal(value, freezing["initial"][name]), name  # step 1 trained them
            assert not torch.equal(value, freezing["none"][name]), name  # steps 2..3 would have too


def test_every_parameter_equals_the_run_frozen_by_hand(freezing):
    assert freezing["schedule"].keys() == freezing["hand"].keys()
    for name, value in freezing["schedule"].items():
        assert torch.equal(value, freezing["hand"][name]), name
    assert freezing["schedule_trainable"] == freezing["hand_trainable"]
    assert all(_layer(n) not in _dynmo_workers.FROZEN for n in freezing["schedule_trainable"])
    assert len(freezing["schedule_trainable"]) < len(freezing["none_trainable"])


def test_freezing_changes_the_other_layers_too(freezing):
    """Guard: the comparison can fail (frozen layers change what the others learn)."""
    changed = [n for n, v in freezing["schedule"].items() if not torch.equal(v, freezing["none"][n])]
    assert any(_layer(n) not in _dynmo_workers.FROZEN for n in changed)


def test_early_exit_layer_matches_the_rule_on_stock_layers(early_exit):
    fast, ref = early_exit["fast"], early_exit["reference"]
    torch.testing.assert_close(fast["losses"], ref["losses"], rtol=1e-6, atol=1e-6)
    assert fast["grads"].keys() == ref["grads"].keys()
    for name, grad in fast["grads"].items():
        torch.testing.assert_close(grad, ref["grads"][name], rtol=1e-5, atol=1e-7, msg=name)


def test_early_exit_skips_tokens_and_changes_the_result(early_exit):
    shares = {}
    for layer, active, total in early_exit["counts"]:
        shares[layer] = active / total
    assert sorted(shares) == [2, 3]  # layers before exit_from_layer run the stock path
    assert 0.3 <= shares[2] <= 0.7  # the threshold is the median confidence entering layer 2
    assert shares[3] <= shares[2]  # exited tokens stay out: their state no longer changes
    assert not torch.allclose(early_exit["fast"]["losses"], early_exit["no_exit"]["losses"])
