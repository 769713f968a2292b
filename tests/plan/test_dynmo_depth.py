"""``dynmo.mod_capacity`` (mixture of depths): routing layers, token counts, recipe rules, flag (pure)."""

import argparse

import pytest

from megatron_slim.commands.train_dynmo import add_dynmo_args, dynmo_overrides
from megatron_slim.plan.dynmo.depth import routed_tokens, routes
from megatron_slim.plan.recipe import load_recipe
from megatron_slim.plan.schema import ConfigError

ONE_SLICE = ("schedule.kind=1f1b", "schedule.num_slices=1")


def test_every_other_layer_routes_a_capacity_share_of_tokens():
    assert [i for i in range(8) if routes(i, 0.5)] == [1, 3, 5, 7]
    assert not any(routes(i, 0.0) for i in range(8))
    assert [routed_tokens(32, c) for c in (0.25, 0.5, 0.3, 1.0, 0.001)] == [8, 16, 9, 32, 1]


@pytest.mark.parametrize(
    "sets, reason",
    [
        (["dynmo.mod_capacity=1.5", *ONE_SLICE], "[0, 1]"),
        (["dynmo.mod_capacity=-0.1", *ONE_SLICE], "[0, 1]"),
        (["dynmo.mod_capacity=0.5"], "schedule.num_slices > 1"),  # tiny-cpu slices by default
        (["dynmo.mod_capacity=0.5", "dynmo.exit_threshold=0.2", *ONE_SLICE], "dynmo.exit_threshold"),
        (["dynmo.mod_capacity=0.5", "parallel.tp=2", *ONE_SLICE], "parallel.tp"),
        (["dynmo.mod_capacity=0.5", "parallel.cp=2", *ONE_SLICE], "parallel.cp"),
    ],
)
def test_recipe_refuses_what_a_router_cannot_see_whole(sets, reason):
    with pytest.raises(ConfigError, match="^dynmo.mod_capacity: .*allowed") as info:
        load_recipe("tiny-cpu", sets)
    assert reason in str(info.value)


def test_flag_is_the_set_entry_it_names():
    parser = argparse.ArgumentParser()
    add_dynmo_args(parser)
    sets = dynmo_overrides(parser.parse_args(["--dynmo-mod-capacity", "0.25"]))
    assert sets == ["dynmo.mod_capacity=0.25"]
    d = load_recipe("tiny-cpu", [*ONE_SLICE, *sets]).dynmo
    assert d.active and d.mixture_of_depths and d.mod_capacity == 0.25


def test_megatron_args_renders_mixture_of_depths_for_the_launcher(capsys):
    from megatron_slim.cli import main

    argv = ["megatron-args", "--recipe", "tiny-cpu", "--set", "dynmo.mod_capacity=0.5", *ONE_SLICE]
    assert main(argv) == 0
    assert "--dynmo-mod-capacity 0.5" in capsys.readouterr().out
