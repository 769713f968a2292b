"""DynMo's simulation: per-layer costs that add up to the recipe's own, phases under a static split
and under rebalancing, and the ``simulate --dynamic`` command."""

import json

import pytest

from megatron_slim.cli import main
from megatron_slim.plan.dynmo.partition import Partition
from megatron_slim.plan.dynmo.pipeline_costs import PartitionedCosts
from megatron_slim.plan.dynmo.schemes import LayerLoad, layer_loads
from megatron_slim.plan.dynmo.study import run_study
from megatron_slim.plan.recipe import load_recipe
from megatron_slim.plan.sim.costs import RecipeCosts

SETS = ["train.iters=80"]
PER_SLICE = ("forward", "backward", "weight_grad", "activation_bytes", "kv_bytes", "kv_grad_bytes", "p2p_bytes")


def test_an_even_split_of_unit_loads_costs_what_the_recipe_costs():
    base = RecipeCosts(load_recipe("tiny-cpu"))
    same = PartitionedCosts(base, Partition.even(8, 4), [LayerLoad()] * 8)
    for name in PER_SLICE:
        for stage in range(4):
            for s in range(len(base.lengths)):
                assert getattr(same, name)(stage, 0, s) == pytest.approx(getattr(base, name)(stage, 0, s), rel=1e-12)
    assert [same.static_bytes(r) for r in range(4)] == pytest.approx([base.static_bytes(r) for r in range(4)])


def test_moving_a_layer_moves_exactly_one_layers_time_and_bytes():
    base = RecipeCosts(load_recipe("tiny-cpu"))
    moved = PartitionedCosts(base, Partition((3, 1, 2, 2)), [LayerLoad()] * 8)
    layer = base.cost.decoder_layer_time(base.lengths[1], base.prefixes[1], False)
    assert moved.forward(0, 0, 1) - base.forward(0, 0, 1) == pytest.approx(layer)
    assert moved.forward(1, 0, 1) - base.forward(1, 0, 1) == pytest.approx(-layer)
    one_layer_static = (moved.static_bytes(0) - base.static_bytes(0), base.static_bytes(1) - moved.static_bytes(1))
    assert one_layer_static[0] == pytest.approx(one_layer_static[1]) and one_layer_static[0] > 0


def test_a_frozen_layer_costs_no_backward_and_saves_no_activations():
    base = RecipeCosts(load_recipe("tiny-cpu"))
    loads = layer_loads("freeze", 1.0, 8, gemm_share=0.5)
    assert [w.backward for w in loads] == [0, 0, 0, 0, 1, 1, 1, 1]
    frozen = PartitionedCosts(base, Partition.even(8, 4), loads)
    layer_bwd = base.cost.decoder_layer_time(base.lengths[0], base.prefixes[0], True)
    assert base.backward(1, 0, 0) - frozen.backward(1, 0, 0) == pytest.approx(2 * layer_bwd)
    assert frozen.kv_bytes(1, 0, 0) == 0


def test_freezing_rebalanced_beats_the_static_split():
    recipe = load_recipe("tiny-cpu", SETS)
    static = run_study(recipe, "freeze", "static", num_phases=4)
    dynmo = run_study(recipe, "freeze", "dynmo", num_phases=4)
    assert all(ph.layers_per_stage == (2, 2, 2, 2) for ph in static.phases)
    assert all(min(ph.layers_per_stage) >= 1 and sum(ph.layers_per_stage) == 8 for ph in dynmo.phases)
    assert dynmo.phases[-1].layers_per_stage[0] > 2  # the frozen front takes more layers
    assert all(d.iteration_time_s <= s.iteration_time_s * (1 + 1e-9) for d, s in zip(dynmo.phases, static.phases))
    assert dynmo.total_s < static.total_s
    migrations = sum(ph.migration_s for ph in dynmo.phases)
    steps = dynmo.steps_per_phase
    assert dynmo.total_s == pytest.approx(sum(ph.iteration_time_s * steps for ph in dynmo.phases) + migrations)


def test_simulate_dynamic_writes_the_speedup(capsys):
    args = ["simulate", "--recipe", "tiny-cpu", "--set", *SETS, "--dynamic", "freeze", "--phases", "4"]
    assert main([*args, "--json", "-"]) == 0
    out = capsys.readouterr().out
    payload = json.loads(out[: out.index("\n}\n") + 3])
    dyn = payload["dynamic"]
    assert set(dyn["policies"]) == {"static", "dynmo", "diffusion"}
    totals = {p: v["total_s"] for p, v in dyn["policies"].items()}
    assert dyn["speedup"] == pytest.approx(totals["static"] / totals["dynmo"])
    assert dyn["speedup"] > 1


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--dynamic", "freeze", "--rebalance", "dynmo,greedy"], "allowed: a comma list of static, dynmo, diffusion"),
        (["--dynamic", "freeze", "--phases", "0"], "--phases 0: allowed: an integer >= 1"),
        (["--dynamic", "freeze", "--set", "parallel.vpp=2"], "parallel.vpp=2; allowed: 1"),
        (["--dynamic", "freeze", "--compare", "1f1b"], "--compare: not available with --dynamic"),
        (["--rebalance", "dynmo"], "--rebalance: only with --dynamic"),
    ],
)
def test_simulate_dynamic_refuses_bad_input(extra, message, capsys):
    assert main(["simulate", "--recipe", "tiny-cpu", *extra]) == 2
    assert message in capsys.readouterr().err


def test_an_unknown_scheme_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        main(["simulate", "--recipe", "tiny-cpu", "--dynamic", "sparse"])
    assert "invalid choice: 'sparse'" in capsys.readouterr().err
