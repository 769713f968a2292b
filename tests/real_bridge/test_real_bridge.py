"""megatron_slim.megatron.bridge against the installed megatron-bridge package (skipped without
it; README.md beside this file says how to run it on a CPU machine)."""

import importlib

import pytest
import torch

pytestmark = pytest.mark.real_bridge


def test_bridge_train_and_eval_modules_imported_before_install_call_the_slimpipe_function():
    train = importlib.import_module("megatron.bridge.training.train")
    evaluation = importlib.import_module("megatron.bridge.training.eval")
    from megatron.core.pipeline_parallel import schedules

    from megatron_slim.megatron import bridge
    from tests.real_bridge import _workers

    original = schedules.get_forward_backward_func
    assert train.get_forward_backward_func is original and evaluation.get_forward_backward_func is original
    handle = bridge.install(_workers.config_container(_workers.real_provider()), num_slices=4)
    try:
        for module in (train, evaluation):
            assert module.get_forward_backward_func(pp_size=1, vp_size=None) is handle.forward_backward_func
    finally:
        handle.remove()
    assert train.get_forward_backward_func is original and evaluation.get_forward_backward_func is original


def test_bridge_local_attention_backend_is_refused_by_name():
    from megatron.core.transformer.enums import AttnBackend

    from megatron_slim.megatron import bridge
    from megatron_slim.plan.schema import ConfigError
    from tests.real_bridge import _workers

    provider = _workers.real_provider()
    provider.attention_backend = AttnBackend.local
    with pytest.raises(ConfigError, match="model.attention_backend"):
        bridge.install(_workers.config_container(provider), num_slices=4)


def test_one_step_of_bridges_own_forward_step_on_its_own_provider_matches_the_unsliced_model():
    from megatron_slim.runtime.spawn import run_ranks
    from tests.real_bridge import _workers

    reports, grads, ref_reports, ref_grads, facts = run_ranks(_workers.real_bridge_step, 1, 4)[0]
    assert facts == {"is_slimpipe": True, "slice_attention_layers": _workers.TINY["num_layers"]}
    for got, want in zip(reports, ref_reports, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert set(grads) == set(ref_grads)
    for name, grad in grads.items():
        assert ((grad - ref_grads[name]).norm() / ref_grads[name].norm()).item() < 1e-5, name
