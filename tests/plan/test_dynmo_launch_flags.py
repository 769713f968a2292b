"""The launcher's ``--dynmo-*`` flags and the recipe's ``dynmo:`` section: ``megatron-args`` renders
what the launcher runs, the launcher parses it back to the same section, and what runs in
``megatron-slim train`` only is refused naming the key or flag."""

from __future__ import annotations

import argparse

import pytest

from megatron_slim.megatron.launch.dynmo_flags import check_dynmo_args, dynmo_from_megatron_args
from megatron_slim.megatron.launch.flags import add_arguments, recipe_to_megatron_args
from megatron_slim.plan.dynmo.options import FreezeStep
from megatron_slim.plan.recipe import load_recipe
from megatron_slim.plan.schema import ConfigError

RUNNABLE = ["dynmo.profile=true", "dynmo.profile_smoothing=0.25", 'dynmo.freeze="3:2-5,6:0"']


def _dynmo_flags(flags: list[str]) -> list[str]:
    start = next(i for i, f in enumerate(flags) if f.startswith("--dynmo-"))
    return flags[start:]


def _parsed(argv: list[str], num_layers: int = 8) -> argparse.Namespace:
    args = add_arguments(argparse.ArgumentParser()).parse_args(argv)
    args.num_layers = num_layers
    return args


def test_megatron_args_renders_the_section_and_the_launcher_reads_it_back():
    recipe = load_recipe("tiny-cpu", RUNNABLE)
    flags = _dynmo_flags(recipe_to_megatron_args(recipe))
    assert flags == ["--dynmo-profile", "--dynmo-profile-smoothing", "0.25", "--dynmo-freeze", "3:2-5,6:0"]
    back = check_dynmo_args(_parsed(flags))
    assert back == recipe.dynmo
    assert back.freeze_steps(8) == (FreezeStep(3, range(2, 6)), FreezeStep(6, range(0, 1)))


def test_the_default_section_renders_no_flag_and_parses_to_the_defaults():
    recipe = load_recipe("tiny-cpu")
    assert not any(f.startswith("--dynmo-") for f in recipe_to_megatron_args(recipe))
    assert dynmo_from_megatron_args(_parsed([])) == recipe.dynmo
    assert dynmo_from_megatron_args(argparse.Namespace()) == recipe.dynmo  # a script's own parser


@pytest.mark.parametrize(
    ("sets", "flags"),
    [
        (
            ["dynmo.exit_threshold=0.25", "dynmo.exit_from_layer=3"],
            ["--dynmo-exit-threshold", "0.25", "--dynmo-exit-from-layer", "3"],
        ),
        (["dynmo.exit_threshold=0.5"], ["--dynmo-exit-threshold", "0.5"]),
        (["dynmo.mod_capacity=0.5", "schedule.num_slices=1"], ["--dynmo-mod-capacity", "0.5"]),
        (['dynmo.prune="2-4:0.5"'], ["--dynmo-prune", "2-4:0.5"]),
    ],
)
def test_early_exit_and_mixture_of_depths_render_and_read_back(sets, flags):
    recipe = load_recipe("tiny-cpu", sets)
    assert _dynmo_flags(recipe_to_megatron_args(recipe)) == flags
    assert check_dynmo_args(_parsed(flags)) == recipe.dynmo


@pytest.mark.parametrize(
    "sets",
    [["dynmo.moe_experts=4"], ["dynmo.profile=true", "dynmo.rebalance=dynmo"], ["dynmo.rebalance_interval=3"]],
)
def test_megatron_args_refuses_what_runs_in_train_only(sets):
    key = sets[-1].split("=")[0]
    with pytest.raises(ConfigError, match=f"^{key}: got .*; runs in `megatron-slim train` only"):
        recipe_to_megatron_args(load_recipe("tiny-cpu", ["parallel.pp=2", *sets]))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--dynmo-exit-threshold", "1.5"], r"--dynmo-exit-threshold: .*allowed: a number in \[0, 1\]"),
        (
            ["--dynmo-exit-threshold", "0.5", "--dynmo-exit-from-layer", "8"],
            r"--dynmo-exit-from-layer: .*allowed: an integer in \[0, --num-layers-1=7\]",
        ),
        (
            ["--dynmo-exit-threshold", "0.5", "--dynmo-mod-capacity", "0.5"],
            "--dynmo-exit-threshold: got 0.5 with --dynmo-mod-capacity 0.5; allowed: 0",
        ),
        (
            ["--dynmo-mod-capacity", "0.5", "--use-slimpipe", "--slimpipe-num-slices", "4"],
            "--dynmo-mod-capacity: got 0.5 with --slimpipe-num-slices 4; allowed: 0",
        ),
        (["--dynmo-mod-capacity", "2"], r"--dynmo-mod-capacity: .*allowed: a number in \[0, 1\]"),
        (
            ["--dynmo-prune", "2-4:1.5"],
            r"--dynmo-prune: the final sparsity must lie in \[0, 1\) .*allowed: \"<first_iteration>",
        ),
        (["--dynmo-freeze", "3:6-8"], r"--dynmo-freeze: .*allowed: layers in \[0, --num-layers-1=7\]"),
        (["--dynmo-freeze", "0:1"], "--dynmo-freeze: .*iterations count from 1"),
        (["--dynmo-profile-smoothing", "1.5"], r"--dynmo-profile-smoothing: .*allowed: a number in \(0, 1\]"),
        (["--dynmo-profile-dir", "out"], "--dynmo-profile-dir: given without --dynmo-profile"),
    ],
)
def test_the_launcher_refuses_bad_flags_naming_them(argv, message):
    with pytest.raises(ConfigError, match=message):
        check_dynmo_args(_parsed(argv))


def test_profiling_is_refused_beside_recomputation_as_in_train():
    args = _parsed(["--dynmo-profile"])
    args.recompute_granularity = "full"
    with pytest.raises(ConfigError, match="--dynmo-profile: got it with --recompute-granularity full"):
        check_dynmo_args(args)
    with pytest.raises(ConfigError, match="dynmo.profile"):
        load_recipe("tiny-cpu", ["dynmo.profile=true", "train.recompute=full"])


@pytest.mark.parametrize(
    ("argv", "megatron", "message"),
    [
        (
            ["--dynmo-exit-threshold", "0.5"],
            {"sequence_parallel": True},
            "got 0.5 with --sequence-parallel; allowed: 0",
        ),
        (["--dynmo-exit-threshold", "0.5"], {"num_experts": 4}, "got 0.5 with --num-experts 4; allowed: 0"),
        (
            ["--dynmo-mod-capacity", "0.5"],
            {"tensor_model_parallel_size": 2},
            "got 0.5 with --tensor-model-parallel-size 2;",
        ),
        (["--dynmo-mod-capacity", "0.5"], {"context_parallel_size": 2}, "got 0.5 with --context-parallel-size 2;"),
        (
            ["--dynmo-prune", "2:0.5"],
            {"tensor_model_parallel_size": 2},
            "got '2:0.5' with --tensor-model-parallel-size 2;",
        ),
        (["--dynmo-prune", "2:0.5"], {"swiglu": False}, "got '2:0.5' with an MLP other than bias-free SwiGLU"),
        (["--dynmo-prune", "2:0.5"], {"add_bias_linear": True}, "got '2:0.5' with an MLP other than bias-free SwiGLU"),
    ],
)
def test_dynamic_layers_are_refused_beside_megatron_flags_they_cannot_follow(argv, megatron, message):
    args = _parsed(argv)
    vars(args).update(megatron)
    with pytest.raises(ConfigError, match=f"^{argv[0]}: {message}"):
        check_dynmo_args(args)
    off = {"sequence_parallel": False, "num_experts": None, "tensor_model_parallel_size": 1, "context_parallel_size": 1}
    off |= {"swiglu": True, "add_bias_linear": False}
    vars(args).update({key: off[key] for key in megatron})
    check_dynmo_args(args)  # the same flags with the Megatron option off are accepted
