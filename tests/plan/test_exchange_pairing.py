"""Context-exchange pairing (``plan/schedule/exchange.py``): invariants, deadlock freedom, text form."""

import dataclasses

import pytest

from megatron_slim.plan.schedule import Action, ScheduleError, generate, lower, validate
from megatron_slim.plan.schedule.exchange import drop_deadlocks, unit_timeline, with_exchange
from megatron_slim.plan.schedule.exchange_blocks import ExchangeBlock, ExchangePlan
from megatron_slim.plan.schedule.ir import Kind, Schedule

SHAPES = [(2, 1, 2, 4), (3, 1, 3, 6), (4, 1, 4, 8), (3, 2, 3, 3), (4, 2, 4, 8), (2, 3, 2, 4)]


def _paired(shape, slice_len=4):
    lengths = [slice_len] * shape[3]
    return with_exchange(lower(generate("slimpipe", *shape)), lengths), lengths


def _work(tokens, prefix):
    """Causal query-key pairs of a slice, written out independently of the planner."""
    return sum(prefix + q + 1 for q in range(tokens))


@pytest.mark.parametrize("shape", SHAPES)
def test_pairs_are_distinct_ranks_of_one_pass_moving_at_most_the_senders_prefix(shape):
    schedule, lengths = _paired(shape)
    plan = ExchangePlan.from_text(schedule.exchange)
    assert plan.blocks, shape
    assert len(plan.groups) == 2 * len(plan.blocks)  # no action in two pairs
    slots = unit_timeline(schedule)
    for p in plan.blocks:
        assert p.sender != p.taker
        assert p.sender_action.kind.is_backward == p.taker_action.kind.is_backward
        assert Kind.W not in (p.sender_action.kind, p.taker_action.kind)
        sender_prefix = sum(lengths[: p.sender_action.slice])
        assert sum(lengths[: p.taker_action.slice]) < sender_prefix
        assert 0 < p.tokens <= sender_prefix and p.tokens % lengths[0] == 0  # whole oldest slices
        assert slots[(p.sender, p.sender_action)][0] == slots[(p.taker, p.taker_action)][0]  # same unit step


@pytest.mark.parametrize("shape", SHAPES)
def test_the_pairing_never_deadlocks(shape):
    schedule, _ = _paired(shape)
    assert validate(schedule) is schedule
    assert drop_deadlocks(schedule) is schedule  # nothing had to be dropped


def test_a_steady_state_pair_balances_causal_work_within_one_moved_slice():
    schedule, lengths = _paired((4, 1, 8, 8), slice_len=16)
    plan = ExchangePlan.from_text(schedule.exchange)
    t = lengths[0]
    steady = [p for p in plan.blocks if p.sender_action.microbatch >= 2 and p.sender_action.microbatch <= 5]
    assert len(steady) > 10
    for p in steady:
        sender = _work(t, t * p.sender_action.slice) - t * p.tokens
        peer = _work(t, t * p.taker_action.slice) + t * p.tokens
        before = _work(t, t * p.sender_action.slice) - _work(t, t * p.taker_action.slice)
        assert abs(sender - peer) <= t * t, p  # one slice more or less would move t*t pairs each way
        assert abs(sender - peer) < before


def test_a_pairing_that_deadlocks_is_reported_and_dropped():
    base = lower(generate("slimpipe", 2, 1, 2, 4))
    good = ExchangePlan.from_text(with_exchange(base, [4] * 4).exchange).blocks
    # rank 1 reaches F1.3 only after rank 0 has run far past its F0.0: a cycle
    bad = ExchangeBlock(0, 1, Action.parse("F1.3"), 0, Action.parse("F0.0"), 0, 4)
    broken = dataclasses.replace(base, exchange=ExchangePlan((bad, *good)).to_text())
    with pytest.raises(ScheduleError, match="context-exchange group member F1.3 on rank 1"):
        validate(broken)
    fixed = drop_deadlocks(broken)
    assert set(ExchangePlan.from_text(fixed.exchange).blocks) == set(good)
    validate(fixed)


def test_the_pairing_rides_in_the_text_form_and_the_digest():
    schedule, _ = _paired((4, 1, 4, 4))
    plain = lower(generate("slimpipe", 4, 1, 4, 4))
    assert Schedule.from_text(schedule.to_text()) == schedule
    assert schedule.digest() != plain.digest()
    assert "# exchange\n" in schedule.to_text() and "# exchange" not in plain.to_text()
    assert schedule.replace_ranks(schedule.ranks).exchange == ""  # a rewritten schedule drops it


def test_one_hand_checked_pairing():
    # slimpipe pp2 m2 n4, unit time: slot 4 runs rank 1's F0.3 (prefix 12) beside rank 0's F1.0 (prefix 0);
    # causal work 4*12+10 vs 10: moving 4 or 8 tokens leaves 16 apart, the smaller move wins
    schedule, _ = _paired((2, 1, 2, 4))
    assert schedule.exchange == "4 1 F0.3 0 F1.0 0 4\n"


def test_bad_blocks_are_refused():
    with pytest.raises(ValueError, match="both rank 1"):
        ExchangeBlock(0, 1, Action.parse("F0.3"), 1, Action.parse("F0.0"), 0, 4)
    with pytest.raises(ValueError, match="kv_start < kv_end"):
        ExchangeBlock(0, 1, Action.parse("F0.3"), 0, Action.parse("B0.0"), 4, 4)
    with pytest.raises(ValueError, match="W action"):
        ExchangeBlock(0, 1, Action.parse("F0.3"), 0, Action.parse("W0.0"), 0, 4)
    with pytest.raises(ValueError, match="lowered"):
        with_exchange(generate("slimpipe", 2, 1, 2, 4), [4] * 4)
