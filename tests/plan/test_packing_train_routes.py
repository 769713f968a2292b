"""SlimPack's CP routes as ``megatron-slim train`` asks for them (``whole_samples`` with a ``cp_route``):
DP-merge is unavailable, so every outlier that fills a window is CP-routed, alone in its MicroPack at
its CP price; the CP plan the runtime runs is the one Zeppelin's own planner makes for the sample."""

import math

import pytest

from megatron_slim.plan.cost.model import CostModel
from megatron_slim.plan.cp.choose import plan_zeppelin
from megatron_slim.plan.cp.estimate import ALL_LAYERS, ZeppelinLayers
from megatron_slim.plan.pack.costs import fit_slice_costs
from megatron_slim.plan.pack.cp_route import CPRoute
from megatron_slim.plan.pack.plan import MicroPack, PackingPlan, Piece
from megatron_slim.plan.pack.slimpack import outliers, solve
from megatron_slim.plan.pack.training import IterationPacking, Sample, Window, cut_samples, pack_iteration
from megatron_slim.plan.recipe import load_recipe
from megatron_slim.plan.schema import ConfigError

SEQ = 128
ROUTES = ["data.packing=slimpack", "parallel.cp=2", "parallel.dp=2", "cp.engine=zeppelin", f"model.seq_length={SEQ}"]
NO_REMAP = ZeppelinLayers(remap=False)


@pytest.fixture(scope="module")
def setup():
    recipe = load_recipe("tiny-cpu", ROUTES)
    cost = CostModel(recipe)
    return recipe, fit_slice_costs(cost, SEQ, SEQ), CPRoute.from_cost_model(cost, SEQ, NO_REMAP)


def test_recipe_runs_routes_only_for_slimpack_under_zeppelin():
    assert load_recipe("tiny-cpu", ROUTES).cp_routes
    assert not load_recipe("tiny-cpu", ROUTES[:-2] + ["cp.engine=ring", f"model.seq_length={SEQ}"]).cp_routes
    assert not load_recipe("tiny-cpu", ["data.packing=bfd", *ROUTES[1:]]).cp_routes
    with pytest.raises(ConfigError, match="cp.remap=false when schedule.kind=slimpipe"):  # no remap layer runs
        load_recipe("tiny-cpu", [*ROUTES, "cp.remap=true"])
    with pytest.raises(ConfigError, match=r"parallel.tp.*1 with data.packing=slimpack and cp.engine=zeppelin \(or"):
        load_recipe("tiny-cpu", [*ROUTES, "parallel.tp=2", "parallel.sequence_parallel=false"])


def test_outliers_that_fill_a_window_are_cp_routed_alone_at_their_cp_price(setup):
    _, costs, route = setup
    lengths = [SEQ, 120, 10, 6, 9]
    plan = solve(lengths, costs, 2, SEQ, budget_s=0.0, whole_samples=True, cp_route=route).plan
    assert outliers(lengths, costs, 2, None) == {0, 1}  # the 120-token one does not fill a window
    assert plan.routes == ((0, "cp"),)
    many = solve([SEQ] * 8, costs, 2, SEQ, budget_s=0.0, whole_samples=True, cp_route=route).plan
    assert not outliers([SEQ] * 8, costs, 2, None) and many.routes == ()  # full, but no outlier
    for s, _ in plan.routes:
        (pack,) = [m for packs in plan.ranks for m in packs if any(p.sample == s for p in m.pieces)]
        assert pack.pieces == (Piece(s, 0, SEQ),)
        fwd, bwd = route.sample_work(SEQ)
        assert math.isclose(pack.forward_s, fwd) and math.isclose(pack.backward_s, bwd)
    without = solve(lengths, costs, 2, SEQ, budget_s=0.0, whole_samples=True).plan
    assert without.routes == () and "routes" not in without.text()


def test_the_cp_plan_is_zeppelins_own_plan_of_the_sample_alone(setup):
    recipe, _, route = setup
    for n in (SEQ, 64, 8):
        assert route.cp_plan(n).digest() == plan_zeppelin((n,), route.topology, route.costs, NO_REMAP).digest()
        assert route.cp_plan(n).picked == route.placement(n)
    default = CPRoute.from_cost_model(CostModel(recipe), SEQ)
    assert default.layers_used == ALL_LAYERS  # simulate's pricing is unchanged


def test_routed_windows_name_each_replicas_routed_sample(setup):
    _, costs, route = setup
    samples = cut_samples(range(4), [300, 40, 20, 9], SEQ)
    packing = pack_iteration("slimpack", samples, costs, 2, SEQ, route)
    routed = {s for s, _ in packing.plan.routes}
    assert routed == {s for s, x in enumerate(samples) if x.length == SEQ}
    found = {}
    for rank in range(2):
        for m, s in packing.cp_routed_windows(rank).items():
            assert [p.sample for p in packing.windows[rank][m].pieces] == [s] and packing.windows[rank][m].padding == 0
            found[s] = rank
    assert set(found) == routed
    assert packing.record()["cp_routed"] == sorted(routed) and "2 CP-routed" in packing.summary()


def test_a_routed_sample_sharing_a_window_is_refused():
    pack = MicroPack((Piece(0, 0, 60), Piece(1, 0, 20)), 1.0, 1.0, 0.0)
    plan = PackingPlan("slimpack", (60, 20), SEQ, math.inf, ((pack,), ()), routes=((0, "cp"),))
    samples = (Sample(0, 0, 60, True), Sample(1, 0, 20, True))
    windows = ((Window(pack.pieces, SEQ - 80),), (Window((), SEQ),))
    packing = IterationPacking("slimpack", samples, plan, windows)
    shared = r"CP-routed sample\(s\) \[0\] share window 0 of DP rank 0 with samples \[1\]"
    with pytest.raises(ConfigError, match=shared):
        packing.cp_routed_windows(0)
