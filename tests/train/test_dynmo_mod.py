"""Mixture of depths (``dynmo.mod_capacity``) against the same rule on stock layers."""

import pytest
import torch

from megatron_slim.runtime.spawn import run_ranks
from tests.overrides import once_per_key
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


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data_cache):
    """``megatron-slim train --dynmo-mod-capacity 0.5``: pp=2 (1F1B) and one process; and one process without."""
    import json

    from megatron_slim.cli import main
    from tests.oracle.reference import UNPIPELINED_UNSLICED
    from tests.train.conftest import SMALL_DATA

    tmp, runs = tmp_path_factory.mktemp("mod"), {}
    sets = ("train.iters=3", "train.global_batch_size=2", "model.seq_length=128", "schedule.num_slices=1")
    for name, more, flags in (
        ("pp2", ("parallel.pp=2", "schedule.kind=1f1b"), ("--dynmo-mod-capacity", "0.5")),
        ("pp1", UNPIPELINED_UNSLICED, ("--dynmo-mod-capacity", "0.5")),
        ("stock", UNPIPELINED_UNSLICED, ()),
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
        runs[name] = json.loads(out.read_text())["losses"]
    return runs


@pytest.mark.slow  # default tier: test_dynmo_moe.py and test_dynmo_train.py run pipelined dynamic models
def test_pipelined_mixture_of_depths_reproduces_the_single_process_losses(trained):
    assert len(trained["pp2"]) == 3
    assert trained["pp2"] == pytest.approx(trained["pp1"], rel=1e-6)
    assert trained["pp1"] != pytest.approx(trained["stock"], rel=1e-6)
