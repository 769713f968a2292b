"""Recompute and offload settings: the recipe schema, and Megatron-LM's flags both ways."""

import argparse

import pytest

from megatron_slim.megatron.launch.args import recipe_from_megatron_args
from megatron_slim.megatron.launch.flags import recipe_to_megatron_args
from megatron_slim.megatron.launch.recompute_flags import recompute_from_megatron_args
from megatron_slim.plan.recipe import load_recipe
from megatron_slim.plan.recompute import RECOMPUTE_CHOICES, Recompute, recompute_choices
from megatron_slim.plan.schema import ConfigError

ONE_F_ONE_B = ["schedule.kind=1f1b", "schedule.num_slices=1"]  # llama2-7b-64k: 32 layers, pp4 -> 8 per stage


def _recipe(*overrides):
    return load_recipe("llama2-7b-64k", ONE_F_ONE_B + list(overrides))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.recompute=partial"], "train.recompute: invalid value (got 'partial'; allowed: 'none' | 'selective'"),
        (
            ["train.recompute=selective", "train.recompute_modules=core_attn,attn"],
            "train.recompute_modules: unknown module 'attn' (got ['core_attn', 'attn']; allowed: a non-empty list "
            "of Megatron-LM's --recompute-modules: core_attn, moe_act, layernorm, mla_up_proj, mlp, moe, "
            "shared_experts)",
        ),
        (["train.recompute_modules=mlp"], "train.recompute_modules: invalid value (got ['mlp']; allowed: unset unless"),
        (["train.recompute=selective", "train.recompute_method=block"], "allowed: unset unless train.recompute=full"),
        (["train.recompute_num_layers=2"], "train.recompute_num_layers: invalid value (got 2; allowed: unset unless"),
        (["train.recompute=full", "train.recompute_num_layers=0"], "allowed: an integer >= 1"),
        (["train.recompute=full", "train.recompute_method=diagonal"], "allowed: 'uniform' | 'block'"),
        (
            ["train.recompute=full", "train.recompute_method=block", "train.recompute_num_layers=9"],
            "train.recompute_num_layers: invalid value (got 9; allowed: an integer in [1, 8]",
        ),
        (
            ["train.recompute=full", "train.recompute_num_layers=3"],
            "a divisor of the 8 layers per pipeline chunk: [1, 2, 4, 8]",
        ),
        (["train.offload_ratio=1.5"], "train.offload_ratio: invalid value (got 1.5; allowed: a fraction in [0, 1])"),
        (["train.offload_ratio=-0.1"], "allowed: a fraction in [0, 1]"),
    ],
)
def test_bad_recompute_settings_name_the_field_and_the_allowed_values(overrides, message):
    with pytest.raises(ConfigError) as exc:
        _recipe(*overrides)
    assert message in str(exc.value)


def test_recompute_full_alone_keeps_its_old_meaning_and_flags():
    recipe = _recipe("train.recompute=full")
    assert recipe.train.recompute_plan == Recompute("full", "uniform", 1)
    flags = recipe_to_megatron_args(recipe)
    i = flags.index("--recompute-granularity")
    assert flags[i : i + 6] == ["--recompute-granularity", "full", "--recompute-method", "uniform"] + [
        "--recompute-num-layers",
        "1",
    ]
    assert "--recompute-granularity" not in recipe_to_megatron_args(_recipe())
    assert _recipe("train.recompute=selective").train.recompute_plan.modules == ("core_attn",)


def _megatron_parser():
    """Megatron-LM's spelling of these flags (generated from TransformerConfig: lists take nargs='+')."""
    p = argparse.ArgumentParser()
    p.add_argument("--recompute-granularity", choices=["full", "selective"])
    p.add_argument("--recompute-method", choices=["uniform", "block"])
    p.add_argument("--recompute-num-layers", type=int)
    p.add_argument("--recompute-modules", nargs="+")
    p.add_argument("--recompute-activations", action="store_true")
    return p


def _recompute_flags(argv):
    out, keep = [], False
    for word in argv:
        if word.startswith("--"):
            keep = word.startswith("--recompute-")
        if keep:
            out.append(word)
    return out


CHOICES = recompute_choices(8) + (Recompute("full", "uniform", 4), Recompute("selective", modules=("layernorm",)))


@pytest.mark.parametrize("choice", CHOICES, ids=str)
def test_every_choice_round_trips_through_megatrons_flags(choice):
    recipe = _recipe(*choice.overrides())
    assert recipe.train.recompute_plan == choice
    args = _megatron_parser().parse_args(_recompute_flags(recipe_to_megatron_args(recipe)))
    fields = recompute_from_megatron_args(args)
    assert fields == choice.train_fields()  # offload 0: no --slimpipe-offload-ratio
    assert load_recipe("llama2-7b-64k", ONE_F_ONE_B + [f"train.{k}={_text(v)}" for k, v in fields.items()]).train == (
        recipe.train
    )


def _text(value):
    return ",".join(value) if isinstance(value, list) else value


def test_the_launcher_reads_megatrons_selective_alias_and_a_whole_namespace():
    alias = _megatron_parser().parse_args(["--recompute-activations"])
    assert recompute_from_megatron_args(alias) == {
        "recompute": "selective",
        "recompute_modules": ["core_attn"],
        "offload_ratio": 0.0,
    }
    namespace = argparse.Namespace(
        num_attention_heads=8,
        num_layers=8,
        hidden_size=64,
        ffn_hidden_size=128,
        seq_length=64,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=2,
        context_parallel_size=1,
        micro_batch_size=1,
        global_batch_size=4,
        slimpipe_hardware="h100",
        slimpipe_num_slices=2,
        slimpipe_slice_policy="uniform",
        recompute_granularity="full",
        recompute_method="block",
        recompute_num_layers=3,
    )
    assert recipe_from_megatron_args(namespace).train.recompute_plan == Recompute("full", "block", 3)
    namespace.slimpipe_offload_ratio = 0.5
    assert recipe_from_megatron_args(namespace).train.recompute_plan == Recompute("full", "block", 3, offload_ratio=0.5)


def test_megatron_args_refuses_what_megatron_cannot_run():
    with pytest.raises(
        ConfigError, match=r"train.offload_ratio: got 0.5 without schedule.kind=slimpipe; the per-slice"
    ):
        recipe_to_megatron_args(_recipe("train.offload_ratio=0.5"))
    with pytest.raises(ConfigError, match="train.recompute_modules: got 'moe_act'; Megatron-LM refuses it"):
        recipe_to_megatron_args(_recipe("train.recompute=selective", "train.recompute_modules=core_attn,moe_act"))


def test_the_choices_a_search_iterates_over_are_distinct_and_load():
    assert len(set(RECOMPUTE_CHOICES)) == len(RECOMPUTE_CHOICES) >= 4
    assert {c.granularity for c in RECOMPUTE_CHOICES} == {"none", "selective", "full"}
    blocks = [c for c in recompute_choices(8) if c.method == "block" and c.granularity == "full"]
    assert [c.num_layers for c in blocks] == list(range(1, 8))
    for choice in recompute_choices(8):
        assert _recipe(*choice.overrides()).train.recompute_plan == choice
