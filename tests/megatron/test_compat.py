"""The version shims dispatch on the installed function's signature: each historical signature
(0.14 .. 0.19) is exercised here with a fake that records what it received."""

from types import SimpleNamespace

import pytest

from megatron_slim.megatron import compat

MODEL_TYPE = "encoder_or_decoder"


class Recorder:
    def __init__(self):
        self.calls = []


# --------------------------------------------------------------------------- backward_step


def make_backward_steps(rec):
    def bwd_014(input_tensor, output_tensor, output_tensor_grad, model_type, config, pipeline_model_parallel_size=1):
        rec.calls.append(
            ("0.14", input_tensor, output_tensor, output_tensor_grad, model_type, config, pipeline_model_parallel_size)
        )
        return "grad"

    def bwd_015(input_tensor, output_tensor, output_tensor_grad, model_type, config):
        rec.calls.append(("0.15", input_tensor, output_tensor, output_tensor_grad, model_type, config))
        return "grad"

    def bwd_017(input_tensor, output_tensor, output_tensor_grad, config):
        rec.calls.append(("0.17", input_tensor, output_tensor, output_tensor_grad, config))
        return "grad"

    return bwd_014, bwd_015, bwd_017


def test_backward_step_dispatches_on_each_historical_signature():
    rec = Recorder()
    bwd_014, bwd_015, bwd_017 = make_backward_steps(rec)
    for fn in (bwd_014, bwd_015, bwd_017):
        assert (
            compat.backward_step("x", "y", "dy", "cfg", model_type=MODEL_TYPE, pipeline_model_parallel_size=4, fn=fn)
            == "grad"
        )
    assert rec.calls == [
        ("0.14", "x", "y", "dy", MODEL_TYPE, "cfg", 4),
        ("0.15", "x", "y", "dy", MODEL_TYPE, "cfg"),
        ("0.17", "x", "y", "dy", "cfg"),
    ]


def test_backward_step_defaults_model_type_where_still_required():
    from megatron.core.enums import ModelType

    rec = Recorder()
    _, bwd_015, _ = make_backward_steps(rec)
    compat.backward_step(None, "y", None, "cfg", fn=bwd_015)
    assert rec.calls[0][4] == ModelType.encoder_or_decoder


# --------------------------------------------------------------------------- forward_step


def test_forward_step_drops_only_keywords_the_installed_version_lacks():
    seen = {}

    def old_forward_step(
        forward_step_func,
        data_iterator,
        model,
        num_microbatches,
        input_tensor,
        forward_data_store,
        config,
        cp_group_size,
        collect_non_loss_data=False,
        checkpoint_activations_microbatch=None,
        is_first_microbatch=False,
        current_microbatch=None,
    ):
        seen.update(locals())
        return "out", 0

    compat.forward_step(
        fn=old_forward_step,
        forward_step_func="f",
        data_iterator="it",
        model="m",
        num_microbatches=2,
        input_tensor=None,
        forward_data_store=[],
        config="c",
        cp_group_size=1,
        vp_stage=1,
        is_last_stage=False,
    )
    assert seen["num_microbatches"] == 2 and "vp_stage" not in seen and "is_last_stage" not in seen

    def kwargs_forward_step(**kwargs):
        seen.clear()
        seen.update(kwargs)

    compat.forward_step(fn=kwargs_forward_step, vp_stage=1, is_last_stage=False)
    assert seen == {"vp_stage": 1, "is_last_stage": False}


# --------------------------------------------------------------------------- finalize_model_grads


def finalize_014(model, num_tokens=None, grad_finalize_pgs=None):
    return ("0.14", model, num_tokens, grad_finalize_pgs)


def finalize_015(model, num_tokens=None, pg_collection=None):
    return ("0.15", model, num_tokens, pg_collection)


def finalize_016(model, num_tokens=None, pg_collection=None, force_all_reduce=False):
    return ("0.16", model, num_tokens, pg_collection, force_all_reduce)


@pytest.mark.parametrize(
    "fn, expected",
    [
        (finalize_014, ("0.14", ["m"], 5, "pgs")),
        (finalize_015, ("0.15", ["m"], 5, "pgs")),
        (finalize_016, ("0.16", ["m"], 5, "pgs", True)),
    ],
)
def test_finalize_model_grads_uses_each_versions_keywords(fn, expected):
    force = True if fn is finalize_016 else None
    assert compat.finalize_model_grads(["m"], 5, groups="pgs", force_all_reduce=force, fn=fn) == expected


def test_finalize_model_grads_kwargs_by_signature():
    assert compat.finalize_model_grads_kwargs(finalize_014, "g") == {"grad_finalize_pgs": "g"}
    assert compat.finalize_model_grads_kwargs(finalize_015, "g", False) == {"pg_collection": "g"}
    assert compat.finalize_model_grads_kwargs(finalize_016, "g", False) == {
        "pg_collection": "g",
        "force_all_reduce": False,
    }
    assert compat.finalize_model_grads_kwargs(finalize_016) == {}


def test_force_all_reduce_true_is_refused_before_016():
    with pytest.raises(ValueError, match="force_all_reduce"):
        compat.finalize_model_grads_kwargs(finalize_015, "g", force_all_reduce=True)


def test_our_groups_are_converted_to_the_class_the_keyword_expects():
    class FakeGroups:
        def as_megatron(self, cls):
            return ("converted", cls.__name__)

    kwargs = compat.finalize_model_grads_kwargs(finalize_016, FakeGroups())
    assert kwargs["pg_collection"][0] == "converted"


# --------------------------------------------------------------------------- process-group keyword


def test_model_groups_keyword_per_version():
    class Module015:
        def __init__(self, config, pg_collection=None):
            pass

    class Module014:
        def __init__(self, config, model_comm_pgs=None):
            pass

    class ModuleOld:
        def __init__(self, config):
            pass

    assert compat.model_groups_keyword(Module015) == "pg_collection"
    assert compat.model_groups_keyword(Module014) == "model_comm_pgs"
    assert compat.model_groups_keyword(ModuleOld) is None
    assert compat.model_groups_kwargs(ModuleOld, object()) == {}
    assert compat.core_attention_groups_keyword(Module014) == "model_comm_pgs"


def test_fill_groups_dataclass_sets_only_declared_fields():
    import dataclasses

    @dataclasses.dataclass
    class Pgs:
        tp: object = dataclasses.field(init=False)
        cp: object = dataclasses.field(init=False)

    pgs = compat.fill_groups_dataclass(Pgs, {"tp": "T", "dp": "D"})
    assert pgs.tp == "T" and not hasattr(pgs, "cp") and not hasattr(pgs, "dp")


# --------------------------------------------------------------------------- layer specs and build


def test_local_layer_submodules_before_and_after_017():
    calls = []
    old = SimpleNamespace(
        get_gpt_layer_local_spec=lambda **kw: calls.append(("spec", kw)) or SimpleNamespace(submodules="subs-from-spec")
    )
    new = SimpleNamespace(
        get_gpt_layer_local_spec=old.get_gpt_layer_local_spec,
        get_gpt_layer_local_submodules=lambda **kw: calls.append(("subs", kw)) or "subs",
    )
    assert compat.local_layer_submodules("RMSNorm", specs_module=old) == "subs-from-spec"
    assert compat.local_layer_submodules("RMSNorm", specs_module=new) == "subs"
    assert calls == [("spec", {"normalization": "RMSNorm"}), ("subs", {"normalization": "RMSNorm"})]


def test_build_prefers_build_module_and_falls_back_to_calling_the_spec():
    with_build = SimpleNamespace(build_module=lambda spec, *a, **kw: ("built", spec, a, kw))
    assert compat.build("spec", 1, spec_utils=with_build, x=2) == ("built", "spec", (1,), {"x": 2})

    class CallableSpec:
        def __call__(self, *args, **kwargs):
            return ("called", args, kwargs)

    assert compat.build(CallableSpec(), 1, spec_utils=SimpleNamespace(), x=2) == ("called", (1,), {"x": 2})


# --------------------------------------------------------------------------- _forward_mlp


class Layer014:
    def _forward_mlp(self, hidden_states, inference_context=None):
        return ("0.14", hidden_states, inference_context)


class Layer016:
    def _forward_mlp(self, hidden_states, inference_context=None, padding_mask=None):
        return ("0.16", hidden_states, inference_context, padding_mask)


class Layer019:
    def _forward_mlp(self, hidden_states, inference_context=None, padding_mask=None, packed_seq_params=None):
        return ("0.19", hidden_states, inference_context, padding_mask, packed_seq_params)


def test_forward_mlp_passes_what_each_version_accepts():
    assert compat.forward_mlp(Layer014(), "h") == ("0.14", "h", None)
    assert compat.forward_mlp(Layer016(), "h", padding_mask="pm") == ("0.16", "h", None, "pm")
    assert compat.forward_mlp(Layer019(), "h", packed_seq_params="p") == ("0.19", "h", None, None, "p")


def test_forward_mlp_refuses_to_drop_a_real_argument():
    with pytest.raises(ValueError, match="padding_mask"):
        compat.forward_mlp(Layer014(), "h", padding_mask="pm")
    with pytest.raises(ValueError, match="packed_seq_params"):
        compat.forward_mlp(Layer016(), "h", packed_seq_params="p")


# --------------------------------------------------------------------------- the installed version


def test_installed_megatron_core_is_dispatched_as_its_version_requires():
    from megatron.core.models.gpt import GPTModel
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

    major, minor, _ = compat.mcore_version()
    assert (major, minor) >= (0, 14)
    expected_groups_kw = "pg_collection" if (major, minor) >= (0, 15) else "model_comm_pgs"
    assert compat.model_groups_keyword(GPTModel) == expected_groups_kw
    assert compat.core_attention_groups_keyword() == expected_groups_kw
    assert compat.has_parameter(schedules.backward_step, "model_type") == ((major, minor) < (0, 17))
    assert isinstance(compat.local_layer_submodules("RMSNorm"), TransformerLayerSubmodules)
