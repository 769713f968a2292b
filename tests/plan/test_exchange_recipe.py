"""``schedule.slice_policy: exchange`` from recipe to simulation: uniform slices, attention moved."""

import pytest

from megatron_slim.commands.simulate import run_one
from megatron_slim.plan.cost.exchange import exchange_work
from megatron_slim.plan.recipe import load_recipe
from megatron_slim.plan.schedule.executable import executable_with_exchange
from megatron_slim.plan.sim.costs import RecipeCosts, slice_lengths
from megatron_slim.plan.sim.exchange_timing import timed_exchange_schedule

SMALL = ["parallel.dp=1", "train.global_batch_size=4", "model.seq_length=131072", "schedule.num_slices=8"]


def test_exchange_keeps_uniform_slices():
    recipe = load_recipe("llama2-7b-64k", [*SMALL, "schedule.slice_policy=exchange"])
    costs = RecipeCosts(recipe)
    assert slice_lengths(recipe, costs.cost) == (16384,) * 8


@pytest.mark.parametrize("backward", [False, True])
def test_the_moved_block_costs_what_it_takes_off_the_senders_causal_attention(backward):
    recipe = load_recipe("llama2-7b-64k", [*SMALL, "schedule.slice_policy=exchange"])
    cost = RecipeCosts(recipe).cost
    t, prefix, moved = 16384, 5 * 16384, 2 * 16384
    time = cost.backward_time if backward else cost.forward_time
    saved = time(1, t, prefix) - time(1, t, prefix - moved)  # attention is linear in the prefix
    work = exchange_work(cost, t, moved, backward)
    assert work.block_s == pytest.approx(saved, rel=1e-9)
    s = cost.shape
    kv = 2 * moved * s.kv_width / s.tp * 2  # K and V, bf16, over this GPU's TP share
    assert work.peer_bytes == pytest.approx(kv + (2 * kv if backward else 0.0))
    assert work.messages == cost.layers_per_stage
    q = t * s.hidden / s.tp * 2
    expected_out = (3 * q + t * s.heads / s.tp * 4 + kv) if backward else (q + kv)
    assert work.out_bytes == pytest.approx(expected_out * cost.layers_per_stage)


def test_exchange_lowers_the_uniform_bubble_and_keeps_uniform_stage0_activations():
    results = {
        policy: run_one(load_recipe("llama2-7b-64k", [*SMALL, f"schedule.slice_policy={policy}"])).result
        for policy in ("uniform", "exchange")
    }
    uniform, exchange = results["uniform"], results["exchange"]
    assert exchange.schedule.exchange  # the simulated schedule carries its pairing
    assert exchange.bubble_ratio < uniform.bubble_ratio
    assert exchange.ranks[0].peak_activation_bytes == uniform.ranks[0].peak_activation_bytes
    assert exchange.to_json()["schedule_digest"] != uniform.to_json()["schedule_digest"]


def test_the_timed_pairing_train_runs_is_the_one_simulate_prices():
    recipe = load_recipe("llama2-7b-64k", [*SMALL, "schedule.slice_policy=exchange"])
    timed = timed_exchange_schedule(recipe, recipe.num_microbatches, (16384,) * 8)
    simulated = run_one(recipe).result.schedule
    assert timed.exchange and timed.digest() == simulated.digest()
    p = recipe.parallel
    unit = executable_with_exchange("slimpipe", p.pp, p.vpp, recipe.num_microbatches, (16384,) * 8)
    assert unit.exchange != timed.exchange  # the unit-time pairing is another one
    assert timed_exchange_schedule(recipe, recipe.num_microbatches, (16384,) * 8) is timed  # planned once per shape
