"""Megatron-Bridge support (``megatron_slim.megatron.bridge``) against the installed megatron-core,
with stand-ins for Bridge's provider and forward step (``_bridge_like``; the real package is
checked by ``tests/real_bridge``)."""

import sys
import types
from types import SimpleNamespace

import pytest
import torch

from megatron_slim.plan.schema import ConfigError
from tests.megatron import _bridge_like
from tests.oracle.models import NARROW_GQA_2L

SCHEDULES = "megatron.core.pipeline_parallel.schedules"


def _getter():
    return sys.modules[SCHEDULES].get_forward_backward_func if SCHEDULES in sys.modules else None


def _bind_by_name(name: str) -> types.ModuleType:
    """A module that imports the getter by name, as Bridge's train.py and eval.py do."""
    module = types.ModuleType(name)
    exec(
        "from megatron.core.pipeline_parallel.schedules import get_forward_backward_func\n"
        "from megatron.core.pipeline_parallel import get_forward_backward_func as via_package\n",
        module.__dict__,
    )
    sys.modules[name] = module
    return module


@pytest.fixture
def installed():
    from megatron_slim.megatron import bridge

    handles = []

    def install(config, **kwargs):
        handles.append(bridge.install(config, **kwargs))
        return handles[-1]

    yield install
    for handle in handles:
        handle.remove()


def test_every_name_bridge_calls_returns_the_slimpipe_function_and_remove_restores_them(installed):
    import megatron.core.pipeline_parallel as pipeline_parallel
    from megatron.core.pipeline_parallel import schedules

    original = schedules.get_forward_backward_func
    before = _bind_by_name("bridge_like_train_before")
    handle = installed(_bridge_like.config_container(), num_slices=4)
    after = _bind_by_name("bridge_like_train_after")
    for getter in (
        schedules.get_forward_backward_func,
        pipeline_parallel.get_forward_backward_func,
        before.get_forward_backward_func,
        before.via_package,
        after.get_forward_backward_func,
        after.via_package,
    ):
        assert getter(pp_size=2, vp_size=None) is handle.forward_backward_func
    assert handle.forward_backward_func.settings.slice_lengths == (8, 8, 8, 8)
    handle.remove()
    for getter in (
        schedules.get_forward_backward_func,
        pipeline_parallel.get_forward_backward_func,
        before.get_forward_backward_func,
        after.via_package,
    ):
        assert getter is original


def test_a_second_install_is_refused_until_the_first_is_removed(installed):
    installed(_bridge_like.config_container(), num_slices=2)
    with pytest.raises(RuntimeError, match="already installed"):
        installed(_bridge_like.config_container(), num_slices=2)


@pytest.mark.parametrize("form", ["callable", "callable_with_vp_stage", "module_spec"])
def test_the_spec_bridge_resolves_has_slice_attention_in_every_form(installed, form):
    from megatron_slim.megatron.slimpipe.slicing import SliceCoreAttention

    seen = []

    def with_vp_stage(config, vp_stage=None):
        seen.append(vp_stage)
        return _bridge_like.local_layer_spec(config)

    provider = _bridge_like.tiny_provider()
    original = {
        "callable": _bridge_like.local_layer_spec,
        "callable_with_vp_stage": with_vp_stage,
        "module_spec": _bridge_like.local_layer_spec(provider),
    }[form]
    provider.transformer_layer_spec = original
    handle = installed(_bridge_like.config_container(provider), num_slices=2)
    spec = provider.layer_spec(vp_stage=1)
    assert spec.submodules.self_attention.submodules.core_attention is SliceCoreAttention
    assert seen == ([1] if form == "callable_with_vp_stage" else [])
    handle.remove()
    assert provider.transformer_layer_spec is original
    assert provider.layer_spec().submodules.self_attention.submodules.core_attention is not SliceCoreAttention


def _set(obj, **values):
    for name, value in values.items():
        setattr(obj, name, value)


REFUSED = {
    "local_attention_backend": (
        lambda c: _set(
            c.model,
            attention_backend=__import__("megatron.core.transformer.enums", fromlist=["AttnBackend"]).AttnBackend.local,
        ),
        {},
        "model.attention_backend",
    ),
    "moe": (lambda c: _set(c.model, num_moe_experts=8), {}, "model.num_moe_experts"),
    "cuda_graphs": (lambda c: _set(c.model, cuda_graph_impl="full_iteration"), {}, "model.cuda_graph_impl"),
    "full_te_layer": (
        lambda c: _set(c.model, use_transformer_engine_full_layer_spec=True),
        {},
        "model.use_transformer_engine_full_layer_spec",
    ),
    "dist_train": (
        lambda c: _set(c.model, dist_train=SimpleNamespace(use_dist_train=True)),
        {},
        "model.dist_train.use_dist_train",
    ),
    "variable_length_batches": (lambda c: _set(c.dataset, dataloader_type="batch"), {}, "dataset.dataloader_type"),
    "packed_sequences": (
        lambda c: _set(c.dataset, enable_in_batch_packing=True),
        {},
        "dataset.enable_in_batch_packing",
    ),
    "document_masks": (lambda c: _set(c.dataset, reset_attention_mask=True), {}, "dataset.reset_attention_mask"),
    "uneven_slices": (lambda c: None, {"num_slices": 5}, "model.seq_length"),
    "cp_alignment": (lambda c: _set(c.model, context_parallel_size=2), {"num_slices": 16}, "install(num_slices=...)"),
    "zero_slices": (lambda c: None, {"num_slices": 0}, "install(num_slices=...): got 0"),
    "slice_count_type": (lambda c: None, {"num_slices": "4"}, "num_slices: got '4'"),
    "slice_policy": (lambda c: None, {"slice_policy": "even"}, "slice_policy: got 'even'"),
    "exchange": (lambda c: None, {"slice_policy": "exchange"}, "not yet under Megatron-Bridge; allowed: uniform"),
    "attention_kernels": (lambda c: None, {"attention_backend": "cudnn"}, "attention_backend: got 'cudnn'"),
    "vocab_parallel": (
        lambda c: None,
        {"vocab_parallel": True},
        "install(vocab_parallel=True): vocab_parallel runs in megatron-slim train only and under Megatron-LM's "
        "launcher (python -m megatron_slim.launch), not under Megatron-Bridge yet; "
        "allowed: vocab_parallel=False",
    ),
    "vocab_parallel_type": (lambda c: None, {"vocab_parallel": "yes"}, "vocab_parallel: got 'yes'"),
    "hardware": (lambda c: None, {"hardware": "tpu-v9"}, "tpu-v9"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_config_slimpipe_cannot_run_is_refused_naming_the_field_before_anything_changes(installed, case):
    change, kwargs, field = REFUSED[case]
    config = _bridge_like.config_container()
    change(config)
    spec, getter = config.model.transformer_layer_spec, _getter()
    with pytest.raises(ConfigError) as caught:
        installed(config, **{"num_slices": 4, **kwargs})
    assert field in str(caught.value)
    assert "--" not in str(caught.value).replace("dataset.", "")  # Bridge field names, not Megatron-LM flags
    assert config.model.transformer_layer_spec is spec and _getter() is getter


def test_a_model_that_is_not_a_gpt_provider_is_refused(installed):
    class MambaModelProvider(SimpleNamespace):
        pass

    config = _bridge_like.config_container(MambaModelProvider(transformer_layer_spec=None, num_layers=2))
    with pytest.raises(ConfigError, match="config.model: MambaModelProvider"):
        installed(config, num_slices=2)


def test_one_bridge_shaped_step_runs_slimpipe_and_matches_the_unsliced_model():
    """install() then train_step's call (0.6.2 train.py:915-926) on one gloo rank: four slices give
    the unsliced loss and every gradient."""
    from megatron_slim.runtime.spawn import run_ranks
    from tests.megatron import _bridge_workers

    reports, grads, ref_reports, ref_grads, facts = run_ranks(_bridge_workers.bridge_step, 1, 4)[0]
    assert facts == {
        "is_slimpipe": True,
        "slice_attention_layers": NARROW_GQA_2L["num_layers"],
        "slice_lengths": (8, 8, 8, 8),
    }
    for got, want in zip(reports, ref_reports, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert set(grads) == set(ref_grads)
    for name, grad in grads.items():
        assert ((grad - ref_grads[name]).norm() / ref_grads[name].norm()).item() < 1e-5, name
