"""``dynmo.prune``: the cubic sparsity schedule, its recipe checks, flag and megatron-args refusal (pure)."""

import argparse

import pytest

from megatron_slim.commands.train_dynmo import add_dynmo_args, dynmo_overrides
from megatron_slim.plan.dynmo.prune import PruneSchedule, parse_prune
from megatron_slim.plan.recipe import load_recipe
from megatron_slim.plan.schema import ConfigError


def test_schedule_is_zhu_and_gupta_cubic_ramp():
    s = parse_prune(" 3-7:0.5 ")
    assert s == PruneSchedule(3, 7, 0.5)
    # by hand: s_t = 0.5 * (1 - (1 - (t - 3) / 4) ** 3)
    expected = {1: 0.0, 2: 0.0, 3: 0.0, 4: 0.5 * (1 - 0.75**3), 5: 0.5 * (1 - 0.5**3), 6: 0.5 * (1 - 0.25**3)}
    for t, value in expected.items():
        assert s.sparsity_at(t) == pytest.approx(value, abs=1e-12), t
    assert s.sparsity_at(7) == s.sparsity_at(100) == 0.5
    # ffn 64: floor(64 * s_t) neurons
    assert [s.pruned_neurons(t, 64) for t in range(2, 9)] == [0, 0, 18, 28, 31, 32, 32]


def test_one_shot_and_never_every_neuron():
    s = parse_prune("4:0.999")
    assert (s.first, s.last) == (4, 4)
    assert s.pruned_neurons(3, 8) == 0
    assert s.pruned_neurons(4, 8) == 7  # floor(7.992); at most ffn - 1 anyway
    assert PruneSchedule(1, 1, 0.25).pruned_neurons(1, 8) == 2  # exact products are not rounded down
    assert parse_prune("") is None


@pytest.mark.parametrize(
    "text, needle",
    [
        ("300.5", "no ':'"),  # what YAML makes of an unquoted 5:0.5
        ("a-3:0.5", "integers"),
        ("5-3:0.5", "first <= last"),
        ("0:0.5", "count from 1"),
        ("2:1", "[0, 1)"),
        ("2:-0.1", "[0, 1)"),
    ],
)
def test_bad_schedules_name_the_field_and_the_format(text, needle):
    with pytest.raises(ConfigError, match="^dynmo.prune: ") as info:
        parse_prune(text)
    assert needle in str(info.value) and "<first_iteration>-<last_iteration>:<final_sparsity>" in str(info.value)


@pytest.mark.parametrize(
    "sets", [['dynmo.prune="2:2"'], ['dynmo.prune="2:0.5"', "parallel.tp=2"], ["dynmo.prune=5:0.5"]]
)
def test_recipe_refuses_bad_pruning(sets):
    with pytest.raises(ConfigError, match="^dynmo.prune: .*allowed"):
        load_recipe("tiny-cpu", sets)


def test_flag_is_the_set_entry_it_names():
    parser = argparse.ArgumentParser()
    add_dynmo_args(parser)
    sets = dynmo_overrides(parser.parse_args(["--dynmo-prune", "2-6:0.5"]))
    assert sets == ['dynmo.prune="2-6:0.5"']
    d = load_recipe("tiny-cpu", sets).dynmo
    assert d.active and d.prune_schedule == PruneSchedule(2, 6, 0.5)


def test_megatron_args_renders_pruning_for_the_launcher(capsys):
    from megatron_slim.cli import main

    assert main(["megatron-args", "--recipe", "tiny-cpu", "--set", 'dynmo.prune="2:0.5"']) == 0
    assert "--dynmo-prune 2:0.5" in capsys.readouterr().out
