"""``dynmo.moe_experts`` / ``moe_topk`` / ``moe_drift``: drift schedule, recipe rules, flags (pure)."""

import argparse

import pytest

from megatron_slim.commands.train_dynmo import add_dynmo_args, dynmo_overrides
from megatron_slim.plan.dynmo.moe import drift_bias
from megatron_slim.plan.recipe import load_recipe
from megatron_slim.plan.schema import ConfigError


def test_drift_bias_grows_linearly_and_tilts_to_the_last_expert():
    assert drift_bias(1, 4, 0.5) == [0.0, 0.0, 0.0, 0.0]
    assert drift_bias(4, 4, 0.5) == pytest.approx([-1.5, -0.5, 0.5, 1.5])  # 0.5 * 3 * (2e/3 - 1)
    assert drift_bias(3, 2, 1.0) == pytest.approx([-2.0, 2.0])
    assert sum(drift_bias(9, 5, 0.3)) == pytest.approx(0.0)


@pytest.mark.parametrize(
    "sets, field",
    [
        (["dynmo.moe_experts=1"], "dynmo.moe_experts"),
        (["dynmo.moe_experts=-2"], "dynmo.moe_experts"),
        (["dynmo.moe_experts=4", "dynmo.moe_topk=5"], "dynmo.moe_topk"),
        (["dynmo.moe_experts=4", "dynmo.moe_topk=0"], "dynmo.moe_topk"),
        (["dynmo.moe_drift=0.5"], "dynmo.moe_drift"),  # no experts to drift
        (["dynmo.moe_experts=4", "dynmo.moe_drift=-1"], "dynmo.moe_drift"),
        (["dynmo.moe_experts=4", "parallel.tp=2"], "dynmo.moe_experts"),
        (["dynmo.moe_experts=4", 'dynmo.prune="2:0.5"'], "dynmo.moe_experts"),
        (["dynmo.moe_experts=4", "dynmo.exit_threshold=0.3"], "dynmo.moe_experts"),
    ],
)
def test_bad_moe_settings_fail_naming_the_field(sets, field):
    with pytest.raises(ConfigError, match=f"^{field}: .*allowed"):
        load_recipe("tiny-cpu", sets)


def test_flags_are_the_set_entries_they_name():
    parser = argparse.ArgumentParser()
    add_dynmo_args(parser)
    args = parser.parse_args(["--dynmo-moe-experts", "8", "--dynmo-moe-topk", "1", "--dynmo-moe-drift", "0.2"])
    sets = dynmo_overrides(args)
    assert sets == ["dynmo.moe_experts=8", "dynmo.moe_topk=1", "dynmo.moe_drift=0.2"]
    d = load_recipe("tiny-cpu", sets).dynmo
    assert d.active and d.moe and (d.moe_experts, d.moe_topk, d.moe_drift) == (8, 1, 0.2)
    assert not load_recipe("tiny-cpu").dynmo.moe


def test_megatron_args_refuses_moe(capsys):
    from megatron_slim.cli import main

    assert main(["megatron-args", "--recipe", "tiny-cpu", "--set", "dynmo.moe_experts=4"]) == 2
    err = capsys.readouterr().err
    assert "dynmo.moe_experts" in err and "megatron-slim train` only" in err and "allowed here: 0 " in err
