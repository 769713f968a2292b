"""The simulator prices a context-exchange pair (``plan/sim/engine.py``) as its docstring says,
checked against hand arithmetic on slimpipe pp2 m2 n4, whose only pair is rank 1's F0.3 (sender)
beside rank 0's F1.0 (peer), both starting at t=10 without exchange."""

import pytest

from megatron_slim.plan.cost.exchange import ExchangeWork
from megatron_slim.plan.cost.model import Link
from megatron_slim.plan.schedule import generate, lower
from megatron_slim.plan.schedule.exchange import with_exchange
from megatron_slim.plan.sim.engine import simulate
from tests.plan.synthetic_costs import SyntheticCosts


class HandCosts(SyntheticCosts):
    """Forward of slice j takes 1 + j, backward twice that; messages are free; exchange fixed."""

    hbm = 1e9

    def __init__(self, block: float) -> None:
        self.work = ExchangeWork(block_s=block, out_bytes=0.5, back_bytes=0.25, messages=1, peer_bytes=100.0)

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
        assert (stage, mb, j, moved, backward) == (1, 0, 3, 4, False)
        return self.work

    def link(self, src, dst):
        return Link(1.0, 0.0, True)  # 1 byte/s: out takes 0.5 s, back 0.25 s


def _events(result):
    return {(e.rank, e.name): (e.start, e.end) for e in result.events if e.stream == "compute"}


@pytest.mark.parametrize(
    "block, sender_end, peer_end",
    [
        # own 4-1=3 ends 13; result back at 10+0.5+1+0.25=11.75. Peer: 1+1 ends 12 (block can start at 10.5)
        (1.0, 13.0, 12.0),
        # own 4-3.5=0.5, but the result is back only at 10+0.5+3.5+0.25=14.25: the sender waits
        (3.5, 14.25, 14.5),
    ],
)
def test_a_pair_moves_the_block_and_the_sender_waits_for_the_result(block, sender_end, peer_end):
    schedule = lower(generate("slimpipe", 2, 1, 2, 4))
    plain = _events(simulate(schedule, HandCosts(block)))
    assert plain[(1, "F0.3")] == (10.0, 14.0) and plain[(0, "F1.0")] == (10.0, 11.0)
    result = simulate(with_exchange(schedule, [4] * 4), HandCosts(block))
    ev = _events(result)
    assert ev[(1, "F0.3")] == (10.0, sender_end)
    assert ev[(0, "F1.0")] == (10.0, peer_end)
    assert ev[(1, "B0.3")][0] == sender_end  # what follows on the sender moves with it
    assert result.ranks[1].busy_s == pytest.approx(simulate(schedule, HandCosts(block)).ranks[1].busy_s - block)
    # the peer holds the moved K/V block while it computes: K/V peak = peer_bytes on rank 0 only
    assert result.ranks[0].peak_kv_bytes == 100.0 and result.ranks[1].peak_kv_bytes == 0.0


def test_costs_without_exchange_are_refused_for_a_paired_schedule():
    plain = type("PlainCosts", (), {k: v for k, v in vars(HandCosts).items() if k != "exchange"})
    schedule = with_exchange(lower(generate("slimpipe", 2, 1, 2, 4)), [4] * 4)
    with pytest.raises(TypeError, match="PlainCosts cannot price context exchange"):
        simulate(schedule, plain(1.0))
