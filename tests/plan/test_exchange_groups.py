"""Group context exchange (``plan/schedule/exchange_groups.py``): the plan's rules, checked
against independent arithmetic, and the simulator's group pricing (``engine._Run._group``)
against its docstring's formulas worked by hand."""

import dataclasses

import pytest

from megatron_slim.plan.cost.exchange import ExchangeWork
from megatron_slim.plan.cost.model import Link
from megatron_slim.plan.recipe import load_recipe
from megatron_slim.plan.schedule import generate, lower
from megatron_slim.plan.schedule.exchange_blocks import ExchangeBlock, ExchangePlan
from megatron_slim.plan.schedule.exchange_groups import equal_time_shares, plan_group_exchange
from megatron_slim.plan.schedule.executable import executable
from megatron_slim.plan.schedule.ir import Action, Kind
from megatron_slim.plan.sim.costs import RecipeCosts
from megatron_slim.plan.sim.engine import simulate
from megatron_slim.plan.sim.exchange_durations import CostDurations
from megatron_slim.plan.sim.exchange_timing import simulate_with_group_exchange
from tests.plan.synthetic_costs import SyntheticCosts

SMALL = ["parallel.dp=1", "train.global_batch_size=4", "model.seq_length=131072", "schedule.num_slices=8"]


def _small():
    recipe = load_recipe("llama2-7b-64k", [*SMALL, "schedule.slice_policy=exchange"])
    p, costs = recipe.parallel, RecipeCosts(recipe)
    schedule = executable(recipe.schedule.kind, p.pp, p.vpp, recipe.num_microbatches, recipe.schedule.num_slices)
    return schedule, costs


@pytest.mark.parametrize(
    "fulls, moves, expected",
    [
        ([10.0, 4.0], [6.0, 0.0], [3.0, 3.0]),  # fixed parts 4 and 4: level 7, 3 s each
        ([10.0, 1.0], [2.0, 0.0], [0.0, 2.0]),  # fixed part 8 stays above the level 3: gives all
        ([5.0, 4.0, 1.0], [1.5, 1.0, 0.0], [0.0, 0.25, 2.25]),  # level (2.5 + 3 + 1) / 2 = 3.25 < 3.5
    ],
)
def test_equal_time_shares_water_fill_the_movable_time(fulls, moves, expected):
    assert equal_time_shares(fulls, moves) == pytest.approx(expected)


class HandDurations:
    """Forward of slice j: 2 + j s, j/2 movable; backward twice both."""

    def full(self, rank, a):
        return (2.0 + a.slice) * (2 if a.kind.is_backward else 1)

    def movable(self, rank, a):
        return 0.0 if a.kind is Kind.W else a.slice / 2 * (2 if a.kind.is_backward else 1)


@pytest.mark.parametrize("granule, tokens", [(1, 4), (3, 3), (8, 8), (9, 0)])
def test_a_two_rank_slot_moves_the_tokens_that_equalise_it(granule, tokens):
    # slimpipe pp2: unit slot 3 holds rank 0's F0.3 (5 s, 1.5 movable, prefix 12) beside rank 1's
    # F0.2 (4 s, 1 movable): level (1.5 + 1 + 3.5 + 3) / 2 = 4.5, so F0.3 gives 0.5 s of its 1.5 s
    # = 12 * 0.5 / 1.5 = 4 tokens to F0.2, rounded to the granule (half up; 0 tokens: no block).
    schedule = lower(generate("slimpipe", 2, 1, 2, 4))
    plan = plan_group_exchange(schedule, [4] * 4, HandDurations(), granule)
    found = [b for b in plan.blocks if b.sender_end == (0, Action(Kind.F, 0, 0, 3))]
    expected = [(0, 1, Action(Kind.F, 0, 0, 2), 0, tokens)] if tokens else []
    assert [(b.sender, b.taker, b.taker_action, b.kv_start, b.kv_end) for b in found] == expected


class EvenDurations:
    """Forward of slice j: 2 + j s, j of them movable: every forward's fixed part is 2 s."""

    def full(self, rank, a):
        return 2.0 + a.slice

    def movable(self, rank, a):
        return float(a.slice)


def test_senders_split_their_excess_by_the_takers_deficits_and_are_served_in_start_order():
    # slimpipe pp4, unit slot 3: F0.3, F0.2, F0.1, F0.0 on ranks 0-3, all fixed parts 2 s, movable
    # 3+2+1+0 = 6: level 3.5, shares 1.5 each. Rank 0 gives 1.5 of 3 s (prefix 12), rank 1 0.5 of 2 s
    # (prefix 8); deficits 0.5 (rank 2) and 1.5 (rank 3). Rank 0: 1.5 x 0.5/2 = 0.375 s -> 12 x
    # 0.375 / 3 = 1.5 -> 2 tokens (half up), then 6 in all; rank 1: 0.5 tokens -> 1, then 2 in all.
    schedule = lower(generate("slimpipe", 4, 1, 4, 4))
    f = [Action(Kind.F, 0, 0, j) for j in range(4)]
    expected = [(0, 2, 0, 2), (0, 3, 2, 6), (1, 2, 0, 1), (1, 3, 1, 2)]
    plan = plan_group_exchange(schedule, [4] * 4, EvenDurations())
    senders = {(0, f[3]), (1, f[2])}
    found = [(b.sender, b.taker, b.kv_start, b.kv_end) for b in plan.blocks if b.sender_end in senders]
    assert found == expected
    assert {b.taker_action for b in plan.blocks if b.sender_end in senders} == {f[1], f[0]}
    starts = {(r, a): 0.0 for r, row in enumerate(schedule.ranks) for a in row if a.kind.is_compute}
    starts[(1, f[2])] = -1.0  # rank 1 starts first: its blocks come first, so takers serve it first
    plan = plan_group_exchange(schedule, [4] * 4, EvenDurations(), starts=starts)
    found = [(b.sender, b.taker, b.kv_start, b.kv_end) for b in plan.blocks if b.sender_end in senders]
    assert found == expected[2:] + expected[:2]


@pytest.mark.parametrize("granule", [1, 16, 3000])
def test_blocks_cover_each_senders_prefix_from_zero_on_granule_bounds(granule):
    schedule, costs = _small()
    plan = plan_group_exchange(schedule, costs.lengths, CostDurations(schedule, costs, costs.lengths), granule)
    assert plan.blocks
    assert not set(plan.sent) & set(plan.served)  # no action in both roles
    for (_, a), blocks in plan.sent.items():
        ranges = sorted((b.kv_start, b.kv_end) for b in blocks)
        assert ranges[0][0] == 0 and all(x[1] == y[0] for x, y in zip(ranges, ranges[1:]))
        assert ranges[-1][1] <= costs.prefixes[a.slice]
        assert all(start % granule == 0 and end % granule == 0 for start, end in ranges)


def test_every_group_ends_level_and_the_moved_work_is_conserved():
    schedule, costs = _small()
    durations = CostDurations(schedule, costs, costs.lengths)
    plan = plan_group_exchange(schedule, costs.lengths, durations)
    steps: dict[int, set] = {}
    for b in plan.blocks:
        steps.setdefault(b.step, set()).update({b.sender_end, b.taker_end})
    for members in steps.values():
        after, spare = {}, {}
        for ra in members:
            mv, prefix = durations.movable(*ra), costs.prefixes[ra[1].slice]
            sent = sum(b.tokens for b in plan.sent.get(ra, ())) * mv / prefix if prefix else 0.0
            taken = sum(
                b.tokens * durations.movable(*b.sender_end) / costs.prefixes[b.sender_action.slice]
                for b in plan.served.get(ra, ())
            )
            after[ra], spare[ra] = durations.full(*ra) - sent + taken, mv - sent
        level = min(after.values())
        for ra, t in after.items():  # level, or above it only having given away all it could
            assert t == pytest.approx(level, rel=1e-3) or (t > level and spare[ra] <= 1e-3 * t)
        total_before = sum(durations.full(*ra) for ra in members)
        assert sum(after.values()) == pytest.approx(total_before, rel=1e-9)


def test_the_group_plan_beats_uniform_slices_and_keeps_uniform_stage0_activations():
    schedule, costs = _small()
    uniform = simulate(schedule, costs)
    groups = simulate_with_group_exchange(schedule, costs, costs.lengths, granule=16)
    assert groups.schedule.exchange
    assert groups.bubble_ratio < uniform.bubble_ratio
    assert groups.ranks[0].peak_activation_bytes == uniform.ranks[0].peak_activation_bytes
    assert sum(r.busy_s for r in groups.ranks) == pytest.approx(sum(r.busy_s for r in uniform.ranks), rel=1e-9)


class GroupCosts(SyntheticCosts):
    """Forward of slice j takes 1 + j; messages free; a block of k tokens: k/8 s, k/4 bytes over,
    0.25 back, over a 1 byte/s link with no latency; the taker holds 10 bytes per token."""

    def forward(self, stage, mb, j):
        return 1.0 + j

    def backward(self, stage, mb, j):
        return 2.0 * (1.0 + j)

    def weight_grad(self, stage, mb, j):
        return 0.0

    def activation_bytes(self, stage, mb, j):
        return 0.0

    backward_transient_bytes = kv_bytes = kv_grad_bytes = p2p_bytes = activation_bytes

    def exchange(self, stage, mb, j, moved, backward):
        return ExchangeWork(
            block_s=moved / 8, out_bytes=moved / 4, back_bytes=0.25, messages=1, peer_bytes=10.0 * moved
        )

    def link(self, src, dst):
        return Link(1.0, 0.0, True)


def test_the_simulator_serves_two_senders_on_one_taker_one_block_after_another():
    # slimpipe pp3: unit slot 3 holds F0.3 (rank 0), F0.2 (rank 1), F0.1 (rank 2); ranks 0 and 1
    # send 8 and 4 tokens to rank 2, rank 0's block first (plan order).
    schedule = lower(generate("slimpipe", 3, 1, 3, 4))
    f = [Action(Kind.F, 0, 0, j) for j in range(4)]
    plan = ExchangePlan((ExchangeBlock(0, 0, f[3], 2, f[1], 0, 8), ExchangeBlock(0, 1, f[2], 2, f[1], 0, 4)))
    plain = {(e.rank, e.name): e.start for e in simulate(schedule, GroupCosts()).events}
    s0, s1, t = plain[(0, "F0.3")], plain[(1, "F0.2")], plain[(2, "F0.1")]
    assert (s0, s1, t) == (6.0, 6.0, 5.0)
    result = simulate(dataclasses.replace(schedule, exchange=plan.to_text()), GroupCosts())
    ev = {(e.rank, e.name): (e.start, e.end) for e in result.events if e.stream == "compute"}
    first = max(t, s0 + 8 / 4) + 8 / 8  # block end = max(previous end (taker start), sender start + over) + block
    second = max(first, s1 + 4 / 4) + 4 / 8
    assert (first, second) == (9.0, 9.5)
    assert ev[(0, "F0.3")] == (s0, max(s0 + 4 - 1.0, first + 0.25))  # own work - block, or block end + back
    assert ev[(1, "F0.2")] == (s1, max(s1 + 3 - 0.5, second + 0.25))
    assert ev[(2, "F0.1")] == (t, max(t + 2 + 1.5, second))
    assert (ev[(0, "F0.3")][1], ev[(1, "F0.2")][1], ev[(2, "F0.1")][1]) == (9.25, 9.75, 9.5)
    assert result.ranks[2].peak_kv_bytes == 120.0 and result.ranks[0].peak_kv_bytes == 0.0
