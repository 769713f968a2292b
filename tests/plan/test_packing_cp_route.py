"""SlimPack's outliers under context parallelism: DP-merge or the CP route (Zeppelin's placement over
the replica's CP group), whichever the cost model prices lower; the figures are recomputed here from
the slice coefficients and the CP cost model (``plan/cp/choose.py``), not through ``cp_route.py``."""

import dataclasses
import json
import math

import pytest

from megatron_slim.cli import main
from megatron_slim.plan.cost.model import CostModel
from megatron_slim.plan.cp.choose import choose_placement
from megatron_slim.plan.cp.costs import CPCosts
from megatron_slim.plan.cp.topology import CPTopology
from megatron_slim.plan.pack.costs import fit_slice_costs
from megatron_slim.plan.pack.cp_route import CPRoute, choose_routes
from megatron_slim.plan.pack.pipeline_costs import routed_scales
from megatron_slim.plan.pack.plan import PackingPlan
from megatron_slim.plan.pack.simulate import simulate_plan
from megatron_slim.plan.pack.slimpack import solve
from megatron_slim.plan.recipe import load_recipe
from megatron_slim.plan.schema import ConfigError

# 64 H100s: dp2 x pp4 x cp8 (tp1), so one replica's CP group is one node (NVLink), and the pipeline
# stage priced (stage 1 of 4) holds 8 decoder layers and neither embedding nor output layer.
LAYOUT = ["parallel.tp=1", "parallel.sequence_parallel=false", "parallel.pp=4", "parallel.cp=8", "parallel.dp=2"]
CAP = 16384
LONG = 131072
LENGTHS = (LONG,) + (4096,) * 200


@pytest.fixture(scope="module")
def setup():
    recipe = load_recipe("llama2-7b-64k", LAYOUT)
    cost = CostModel(recipe)
    assert recipe.train.recompute == "none" and cost.layers_per_stage == 8
    return recipe, cost, fit_slice_costs(cost, CAP, LONG)


def pieces_of(plan, sample):
    return [(r, m, p) for r, packs in enumerate(plan.ranks) for m in packs for p in m.pieces if p.sample == sample]


def slice_work(c, n, prefix):
    """Forward + backward of a slice of ``n`` tokens at ``prefix``, from the coefficients."""
    pairs = n * prefix + n * (n + 1) / 2
    return (c.fwd_per_token + c.bwd_per_token) * n + (c.fwd_per_pair + c.bwd_per_pair) * pairs


def zeppelin_seconds(topo, cp_costs, n, layers):
    """One layer of Zeppelin's pick for the sample alone, times the stage's layers (no recompute)."""
    choice = choose_placement((n,), topo, cp_costs)
    return layers * choice.priced[choice.picked].time_s


def test_cp_route_wins_for_a_very_long_sample_over_nvlink(setup):
    recipe, cost, costs = setup
    route = CPRoute.from_cost_model(cost, CAP)
    plan = solve(LENGTHS, costs, 2, CAP, outlier_tokens=CAP, budget_s=0.0, cp_route=route).plan
    assert plan.routes == ((0, "cp"),)
    cp_s = zeppelin_seconds(CPTopology.from_hardware(cost.hw, 8, 1), CPCosts.from_recipe(recipe, cost), LONG, 8)
    held = pieces_of(plan, 0)
    assert len({r for r, _, _ in held}) == 1  # the whole document on one replica
    # DP-merged, its slices (the same balanced ones) would pay their work plus the prefix K/V received
    # (forward) and the dK/dV sent back (backward)
    dp_s = math.fsum(slice_work(costs, p.length, p.start) + 3 * costs.kv_transfer_per_token * p.start for *_, p in held)
    share = (math.fsum(slice_work(costs, n, 0) for n in LENGTHS[1:]) + dp_s) / 2
    assert cp_s < dp_s and cp_s <= share
    # the plan prices the document at the CP route's figure (its replica's other documents as usual)
    rank = held[0][0]
    others = [p for m in plan.ranks[rank] for p in m.pieces if p.sample != 0]
    assert all(p.start == 0 and p.length == 4096 for p in others)
    priced = plan.rank_forward()[rank] + plan.rank_backward()[rank]
    assert priced == pytest.approx(cp_s + len(others) * slice_work(costs, 4096, 0), rel=1e-9)


def test_dp_merge_wins_when_the_cp_group_only_has_slow_links(setup):
    recipe, cost, costs = setup
    slow = CPTopology.uniform(8, 1, nic_bandwidth=1e9)  # every CP rank on its own node, a 1 GB/s NIC share
    cp_costs = CPCosts.from_recipe(recipe, cost)
    route = CPRoute(slow, cp_costs, layers=8)
    lengths = (3 * CAP,) + (4096,) * 40
    result = solve(lengths, costs, 2, CAP, outlier_tokens=CAP, budget_s=0.0, cp_route=route)
    assert result.plan.routes == ((0, "dp-merge"),) and result.merged[:1] == (0,)
    held = pieces_of(result.plan, 0)
    dp_s = math.fsum(slice_work(costs, p.length, p.start) + 3 * costs.kv_transfer_per_token * p.start for *_, p in held)
    assert zeppelin_seconds(slow, cp_costs, lengths[0], 8) > dp_s


def test_a_cheaper_cp_route_longer_than_a_replica_share_is_not_taken():
    # sample 0: CP 10 s < DP-merge 12 s, but the share with it DP-merged is (12 + 4) / 2 = 8 s < 10 s;
    # sample 1: CP 1 s < DP-merge 2 s, share (2 + 2 + 10) / 2 = 7 s (sample 0 at its cheaper price)
    routes = choose_routes([0, 1], [11.0, 1.5, 2.0, 2.0], {0: 12.0, 1: 2.0}, {0: 10.0, 1: 1.0}, 2)
    assert routes == {0: "dp-merge", 1: "cp"}


def test_routes_are_in_the_digest_and_the_plan_is_deterministic(setup):
    _, cost, costs = setup
    route = CPRoute.from_cost_model(cost, CAP)
    a = solve(LENGTHS, costs, 2, CAP, outlier_tokens=CAP, budget_s=0.0, cp_route=route).plan
    b = solve(LENGTHS, costs, 2, CAP, outlier_tokens=CAP, budget_s=0.0, cp_route=route).plan
    assert a.digest() == b.digest() and "routes 0:cp" in a.text().splitlines()[1]
    assert dataclasses.replace(a, routes=((0, "dp-merge"),)).digest() != a.digest()
    without = solve(LENGTHS, costs, 2, CAP, outlier_tokens=CAP, budget_s=0.0).plan
    assert without.routes == () and not without.text().splitlines()[1].startswith("routes")


def test_the_plan_refuses_a_cp_routed_sample_on_two_ranks_and_unknown_routes(setup):
    _, _, costs = setup
    plan = solve((CAP * 3, 4096, 4096), costs, 2, CAP, outlier_tokens=CAP, budget_s=0.0).plan
    assert len({r for r, _, _ in pieces_of(plan, 0)}) == 2  # DP-merged over both replicas
    with pytest.raises(ConfigError, match=r"CP-routed sample 0 sits on DP ranks \[0, 1\] \(allowed: one\)"):
        PackingPlan(plan.method, plan.sample_lengths, plan.token_cap, plan.memory_cap, plan.ranks, ((0, "cp"),))
    with pytest.raises(ConfigError, match="route 1:ring: allowed a sample of 0..2 and a route of cp | dp-merge"):
        PackingPlan(plan.method, plan.sample_lengths, plan.token_cap, plan.memory_cap, plan.ranks, ((1, "ring"),))


def test_the_simulator_times_cp_routed_pieces_at_the_route_price(setup):
    recipe, cost, costs = setup
    route = CPRoute.from_cost_model(cost, CAP)
    plan = solve(LENGTHS, costs, 2, CAP, outlier_tokens=CAP, budget_s=0.0, cp_route=route).plan
    fwd, bwd = route.sample_work(LONG)
    scales = routed_scales(plan, cost)
    assert scales == {0: pytest.approx((fwd / cost.forward_time(1, LONG, 0), bwd / cost.backward_time(1, LONG, 0)))}
    assert scales[0][0] < 1 and scales[0][1] < 1  # Zeppelin's split beats the uniform one here
    routed = simulate_plan(plan, cost)
    uniform = simulate_plan(dataclasses.replace(plan, routes=()), cost)
    assert routed.outlier_routes == (("cp", 1), ("dp-merge", 0)) and uniform.outlier_routes == ()
    assert routed.iteration_time_s < uniform.iteration_time_s


def test_simulate_packing_reports_outliers_by_route_under_cp(tmp_path, capsys):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("2048\n" + "128\n" * 16)
    out = tmp_path / "pack.json"
    argv = ["simulate", "--recipe", "tiny-cpu", "--set", "parallel.dp=2", "parallel.pp=2", "parallel.cp=2"]
    argv += ["--lengths", str(lengths), "--packing", "slimpack,megatron", "--micropack-tokens", "256"]
    assert main([*argv, "--json", str(out)]) == 0
    packing = json.loads(out.read_text())["packing"]
    routes = packing["slimpack"]["outlier_routes"]
    assert set(routes) == {"cp", "dp-merge"} and sum(routes.values()) == 1
    assert "outlier_routes" not in packing["megatron"]
    assert "slimpack outliers by route:" in capsys.readouterr().out
