"""Idle-time exchange pairs (``plan/sim/exchange_slack.py``): each one keeps its peer within its
deadline and shortens its sender by what the engine then simulates, and adding them lowers the
bubble of the tiny-cpu pp4 exchange recipe (checked against the engine, not against the planner)."""

import dataclasses

import pytest

from megatron_slim.plan.recipe import load_recipe
from megatron_slim.plan.schedule.exchange import with_exchange
from megatron_slim.plan.schedule.exchange_blocks import ExchangePlan
from megatron_slim.plan.schedule.executable import executable
from megatron_slim.plan.schedule.ir import Action
from megatron_slim.plan.sim.costs import RecipeCosts
from megatron_slim.plan.sim.engine import simulate
from megatron_slim.plan.sim.exchange_slack import losing_pairs, slack_pairs, timed_actions
from megatron_slim.plan.sim.exchange_timing import simulate_with_exchange


@pytest.fixture(scope="module")
def tiny_pp4():
    recipe = load_recipe("tiny-cpu", ["parallel.pp=4", "schedule.slice_policy=exchange"])
    costs = RecipeCosts(recipe)
    p = recipe.parallel
    schedule = executable(recipe.schedule.kind, p.pp, p.vpp, recipe.num_microbatches, len(costs.lengths))
    return schedule, costs


def _compute(result):
    return {(e.rank, Action.parse(e.name)): (e.start, e.end) for e in result.events if e.stream == "compute"}


def test_deadline_is_the_next_start_on_the_rank_at_most(tiny_pp4):
    schedule, costs = tiny_pp4
    result = simulate(schedule, costs)
    timed = timed_actions(result, costs)
    spans = _compute(result)
    assert set(timed) == set(spans)
    for rank in range(schedule.pp):
        mine = sorted((s, e, ra) for ra, (s, e) in spans.items() if ra[0] == rank)
        for (_, end, ra), (next_start, _, _) in zip(mine, mine[1:]):
            assert (timed[ra].start, timed[ra].end) == spans[ra]
            assert end <= timed[ra].deadline <= max(next_start, end)


def test_each_pair_alone_shortens_its_sender_and_keeps_its_peer_in_time(tiny_pp4):
    schedule, costs = tiny_pp4
    base = simulate(schedule, costs)
    spans, timed = _compute(base), timed_actions(base, costs)
    pairs = slack_pairs(base, costs, costs.lengths, 0, ExchangePlan())
    assert pairs
    prefixes = {sum(costs.lengths[:k]) for k in range(1, len(costs.lengths))}
    for pair in pairs[:5]:
        sender, peer = (pair.sender, pair.sender_action), (pair.taker, pair.taker_action)
        assert pair.tokens in prefixes and pair.tokens <= sum(costs.lengths[: pair.sender_action.slice])
        alone = simulate(dataclasses.replace(schedule, exchange=ExchangePlan((pair,)).to_text()), costs)
        paired = _compute(alone)
        assert paired[sender][0] == pytest.approx(spans[sender][0])
        assert paired[sender][1] < spans[sender][1]
        assert paired[peer][1] <= timed[peer].deadline + 1e-12


def test_idle_time_pairs_lower_the_bubble(tiny_pp4):
    schedule, costs = tiny_pp4
    mirrored = simulate_with_exchange(schedule, costs, costs.lengths, slack_rounds=0)
    both = simulate_with_exchange(schedule, costs, costs.lengths)
    assert both.bubble_ratio < mirrored.bubble_ratio - 0.01


def test_losing_pairs_are_those_whose_sender_took_no_less_than_unpaired(tiny_pp4):
    schedule, costs = tiny_pp4
    unpaired = {ra: e - s for ra, (s, e) in _compute(simulate(schedule, costs)).items()}
    unit = simulate(with_exchange(schedule, costs.lengths), costs)  # pairs on unit time: some senders wait
    paired = {ra: e - s for ra, (s, e) in _compute(unit).items()}
    pairs = ExchangePlan.from_text(unit.schedule.exchange).blocks
    expected = {p for p in pairs if paired[(p.sender, p.sender_action)] >= unpaired[(p.sender, p.sender_action)]}
    assert expected and expected != set(pairs)
    assert losing_pairs(unit, costs) == expected
