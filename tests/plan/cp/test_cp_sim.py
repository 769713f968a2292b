import dataclasses
import json

import pytest

from megatron_slim.plan.cp.engines import ENGINES, plan_pack
from megatron_slim.plan.cp.lengths import make_packs, parse_lengths
from megatron_slim.plan.cp.remap import plan_remap_for
from megatron_slim.plan.cp.routing import route_transfer
from megatron_slim.plan.cp.topology import CPTopology
from megatron_slim.plan.cp.zigzag import causal
from megatron_slim.plan.recipe import load_recipe
from megatron_slim.plan.schema import ConfigError
from megatron_slim.plan.sim.cp.events import TaskGraph, run
from megatron_slim.plan.sim.cp.layer import simulate_pass
from megatron_slim.plan.sim.cp.network import Network
from megatron_slim.plan.sim.cp.sim import cp_setup, simulate_cp

from .conftest import RECIPE, packs, topology


def busy(res, kind):
    return sum(res.busy[r].get(kind, 0.0) for r in res.busy)


def test_one_rank_is_the_sum_of_its_kernels(costs):
    topo = CPTopology.uniform(1, 1)
    plan = plan_pack("zeppelin", (1000, 24), topo, costs)
    fwd = simulate_pass(plan, topo, costs, backward=False)
    bwd = simulate_pass(plan, topo, costs, backward=True)
    c, n, pairs = costs, 1024, causal(1000) + causal(24)
    assert fwd.time_s == pytest.approx(n * (c.pre_fwd_s + c.post_fwd_s + c.mlp_fwd_s) + pairs * c.pair_fwd_s)
    assert bwd.time_s == pytest.approx(n * (c.pre_bwd_s + c.post_bwd_s + c.mlp_bwd_s) + pairs * c.pair_bwd_s)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", ["2x2", "4x8"])
def test_every_engine_computes_each_causal_pair_once(engine, name, costs):
    topo = topology(name)
    total = 20_000 if name == "2x2" else 6_000  # 32 ranks: a smaller tiny-sequence pack keeps it quick
    for lengths in packs(seed=9, count=4, total=total):
        plan = plan_pack(engine, lengths, topo, costs)
        remap = plan_remap_for(plan, topo) if engine == "zeppelin" else None
        pairs = sum(causal(s) for s in lengths)
        for backward, per_pair in ((False, costs.pair_fwd_s), (True, costs.pair_bwd_s)):
            res = simulate_pass(plan, topo, costs, backward=backward, remap=remap)
            assert busy(res, "attention") == pytest.approx(pairs * per_pair, rel=1e-9)
            per_token = (
                (costs.pre_bwd_s + costs.post_bwd_s + costs.mlp_bwd_s)
                if backward
                else (costs.pre_fwd_s + costs.post_fwd_s + costs.mlp_fwd_s)
            )
            assert busy(res, "linear") == pytest.approx(sum(lengths) * per_token, rel=1e-9)
            assert res.time_s >= max(sum(b.values()) for b in res.busy.values()) - 1e-12


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("tokens", [3, 257])  # fewer tokens than the 4 ranks; many one-token documents
def test_every_engine_prices_one_token_only_packs(engine, tokens, costs):
    """Ranks without tokens still run their groups' collectives: the pass completes and every token
    and causal pair is priced once."""
    topo = topology("2x2")
    lengths = (1,) * tokens
    plan = plan_pack(engine, lengths, topo, costs)
    remap = plan_remap_for(plan, topo) if engine == "zeppelin" else None
    for backward, per_pair in ((False, costs.pair_fwd_s), (True, costs.pair_bwd_s)):
        res = simulate_pass(plan, topo, costs, backward=backward, remap=remap)
        assert busy(res, "attention") == pytest.approx(tokens * per_pair, rel=1e-9)
        assert res.time_s > 0


def test_comm_bound_ring_takes_one_hop_per_step(costs):
    free = dataclasses.replace(costs, pair_fwd_s=0.0, pre_fwd_s=0.0, post_fwd_s=0.0, mlp_fwd_s=0.0)
    topo = CPTopology.uniform(1, 4, nvlink_bandwidth=1e9, nvlink_latency=1e-6)
    plan = plan_pack("ring", (800,), topo, free)  # 100 tokens per chunk, 200 per member
    res = simulate_pass(plan, topo, free, backward=False)
    hop = 200 * free.kv_bytes / 1e9 + 1e-6
    assert res.time_s == pytest.approx(3 * hop)


def test_routed_transfer_in_the_simulator_matches_the_topology_estimate():
    topo = topology("4x8")
    size, per_row = 8192, 16384.0
    route = route_transfer(topo, 3, 11, size, per_row)
    graph = TaskGraph(topo.num_ranks)
    Network(topo, graph).routed(route, per_row, ())
    routed = run(graph).makespan
    assert routed == pytest.approx(topo.routed_transfer_time(size * per_row), rel=1e-9)
    assert routed < topo.nic.transfer_time(size * per_row) / 2


def test_zeppelin_beats_ring_on_the_h800_recipe_with_short_sequences():
    recipe = load_recipe(RECIPE, ["train.global_batch_size=2"])
    lengths = make_packs(
        parse_lengths("lognormal:mean=4096,sigma=1.2,min=256,max=65536"), recipe.model.seq_length, 2, seed=0
    )
    zeppelin = simulate_cp(recipe, "zeppelin", lengths)
    ring = simulate_cp(recipe, "ring", lengths)
    assert zeppelin.iteration_time_s < ring.iteration_time_s / 2
    assert zeppelin.remap and zeppelin.routing and not ring.remap
    assert zeppelin.tokens_per_s > ring.tokens_per_s and 0 < zeppelin.mfu < 1
    # the ring's traffic crosses NICs, Zeppelin keeps short sequences at home
    inter = lambda res: sum(r.inter_node_bytes for r in res.ranks)  # noqa: E731
    assert inter(zeppelin) < inter(ring) / 5
    json.dumps(zeppelin.to_json())


def test_remap_balances_the_mlp_tokens():
    recipe = load_recipe(RECIPE, ["train.global_batch_size=1"])
    lengths = make_packs(
        parse_lengths("lognormal:mean=8192,sigma=1.1,min=1024,max=65536"), recipe.model.seq_length, 1, seed=1
    )
    on = simulate_cp(recipe, "zeppelin", lengths, remap=True)
    off = simulate_cp(recipe, "zeppelin", lengths, remap=False)
    spread = lambda res: max(r.linear_tokens for r in res.ranks) - min(r.linear_tokens for r in res.ranks)  # noqa
    assert spread(on) <= 1 < spread(off)


@pytest.mark.parametrize("override,field", [("parallel.pp=2", "parallel.pp"), ("parallel.dp=2", "parallel.dp")])
def test_pipeline_and_data_parallel_are_rejected_by_name(override, field):
    recipe = load_recipe(RECIPE, [override])
    with pytest.raises(ConfigError, match=field):
        cp_setup(recipe)


def test_packs_must_fill_the_sequence_length(recipe):
    with pytest.raises(ConfigError, match="packs\\[0\\]"):
        simulate_cp(recipe, "ring", ((5, 6),))
