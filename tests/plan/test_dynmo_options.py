"""The recipe's ``dynmo:`` section, its ``--dynmo-*`` flags, and the measured profile as the
repartitioner reads it (pure: no torch)."""

import argparse
import random

import pytest

from megatron_slim.commands.train_dynmo import add_dynmo_args, dynmo_overrides
from megatron_slim.plan.dynmo.costs import LayerCost
from megatron_slim.plan.dynmo.options import FreezeStep, frozen_layers, parse_freeze
from megatron_slim.plan.dynmo.profile import LayerProfile, layer_costs, merged, smoothed
from megatron_slim.plan.recipe import load_recipe
from megatron_slim.plan.schema import ConfigError


def test_freeze_schedule_parses_and_accumulates():
    steps = parse_freeze(" 5:0-3, 10:4-5 ,12:7", 8)
    assert steps == (FreezeStep(5, range(0, 4)), FreezeStep(10, range(4, 6)), FreezeStep(12, range(7, 8)))
    assert frozen_layers(steps, 4) == frozenset()
    assert frozen_layers(steps, 5) == frozenset(range(4))
    assert frozen_layers(steps, 11) == frozenset(range(6))
    assert frozen_layers(steps, 99) == frozenset({0, 1, 2, 3, 4, 5, 7})
    assert parse_freeze("", 8) == ()


@pytest.mark.parametrize(
    "text, needle",
    [
        ("5", "no ':'"),
        ("x:1", "not integers"),
        ("0:1", "iterations count from 1"),
        ("3:4-2", "first <= last"),
        ("3:-1", "not integers"),
    ],
)
def test_bad_freeze_schedules_name_the_entry_and_the_format(text, needle):
    with pytest.raises(ConfigError, match="dynmo.freeze") as info:
        load_recipe("tiny-cpu", [f'dynmo.freeze="{text}"'])
    assert needle in str(info.value) and "<from_iteration>:<first>-<last>" in str(info.value)


@pytest.mark.parametrize(
    "sets, field",
    [
        (['dynmo.freeze="2:6-8"'], "dynmo.freeze"),  # tiny-cpu has layers 0..7
        (["dynmo.exit_threshold=1.5"], "dynmo.exit_threshold"),
        (["dynmo.exit_threshold=0.5", "dynmo.exit_from_layer=8"], "dynmo.exit_from_layer"),
        (["dynmo.profile_smoothing=0"], "dynmo.profile_smoothing"),
        (["dynmo.exit_threshold=0.5", "cp.remap=true"], "dynmo.exit_threshold"),
        (["dynmo.profile=true", "train.recompute=full"], "dynmo.profile"),
    ],
)
def test_bad_dynmo_settings_fail_naming_the_field(sets, field):
    with pytest.raises(ConfigError, match=f"^{field}: .*allowed"):
        load_recipe("tiny-cpu", sets)


def test_flags_are_the_set_entries_they_name():
    parser = argparse.ArgumentParser()
    add_dynmo_args(parser)
    args = parser.parse_args(
        ["--dynmo-profile", "--dynmo-freeze", "5:10", "--dynmo-exit-threshold", "0.3", "--dynmo-exit-from-layer", "2"]
    )
    sets = dynmo_overrides(args)
    d = load_recipe("tiny-cpu", ["model.num_layers=16", *sets]).dynmo
    assert (d.profile, d.freeze, d.exit_threshold, d.exit_from_layer) == (True, "5:10", 0.3, 2)
    assert dynmo_overrides(parser.parse_args([])) == []
    assert not load_recipe("tiny-cpu").dynmo.active


def _profile(layer, rng):
    return LayerProfile(layer, rng.random(), rng.random(), 100 * layer, 10, 20, rng.random() * 1e6)


def test_smoothing_is_an_exponential_average_of_times_and_activations():
    rng = random.Random(3)
    history = [_profile(2, rng) for _ in range(6)]
    weight = 0.3
    state = None
    for p in history:
        state = smoothed(state, p, weight)
    for field in ("forward_s", "backward_s", "activation_bytes"):
        values = [getattr(p, field) for p in history]
        expected = values[0] * (1 - weight) ** 5 + sum(
            weight * (1 - weight) ** (5 - i) * v for i, v in enumerate(values) if i > 0
        )
        assert getattr(state, field) == pytest.approx(expected, rel=1e-12)
    assert (state.parameter_bytes, state.static_bytes) == (200, 230)
    assert smoothed(history[0], history[1], 1.0) == history[1]


def test_ranks_profiles_merge_in_layer_order_into_layer_costs():
    rng = random.Random(5)
    ranks = [[_profile(i, rng) for i in (3, 4, 5)], [_profile(i, rng) for i in (0, 1, 2)]]
    whole = merged(ranks)
    assert [p.layer for p in whole] == list(range(6))
    costs = layer_costs(whole)
    assert costs[4] == LayerCost(whole[4].forward_s, whole[4].backward_s, 430.0, whole[4].activation_bytes)
    with pytest.raises(ValueError, match="exactly once"):
        merged([ranks[0], ranks[0]])
    with pytest.raises(ValueError, match="exactly once"):
        layer_costs(ranks[0])


def test_megatron_args_refuses_what_only_train_runs(capsys):
    from megatron_slim.cli import main

    assert main(["megatron-args", "--recipe", "tiny-cpu", "--set", "dynmo.moe_experts=4"]) == 2
    assert "dynmo.moe_experts: got 4; runs in `megatron-slim train` only (dynmo's MoE" in capsys.readouterr().err
    assert main(["megatron-args", "--recipe", "tiny-cpu"]) == 0
    capsys.readouterr()
    assert main(["megatron-args", "--recipe", "tiny-cpu", "--set", "dynmo.profile=true"]) == 0  # the launcher runs it
    assert "--dynmo-profile" in capsys.readouterr().out
