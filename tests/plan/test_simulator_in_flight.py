"""The simulator counts point-to-point buffers while they are in flight and stalls a sender whose
link's send window is full, as the runtime does (``plan/sim/in_flight.py``, ``schedule/walk.py``)."""

from megatron_slim.plan.cost.model import Link
from megatron_slim.plan.schedule import Action, add_communication, generate, validate
from megatron_slim.plan.schedule.executable import executable, executable_forward_only
from megatron_slim.plan.schedule.walk import SEND_WINDOW, bounded_sends, window_waits
from megatron_slim.plan.sim.engine import simulate
from tests.plan.synthetic_costs import SyntheticCosts

M, A, STATIC = 1000.0, 5000.0, 7.0  # message, activation and static bytes


class UnitCosts(SyntheticCosts):
    """F takes ``forward_s[rank]``, B twice that; a message takes 0.5 s on the link."""

    static = STATIC

    def __init__(self, forward_s=(1.0, 1.0)):
        self.forward_s = forward_s

    def forward(self, stage, mb, j):
        return self.forward_s[stage % len(self.forward_s)]

    def backward(self, stage, mb, j):
        return 2 * self.forward(stage, mb, j)

    def weight_grad(self, stage, mb, j):
        return 0.0

    def activation_bytes(self, stage, mb, j):
        return A

    def backward_transient_bytes(self, stage, mb, j):
        return 0.0

    def kv_bytes(self, stage, mb, j):
        return 0.0

    def kv_grad_bytes(self, stage, mb, j):
        return 0.0

    def p2p_bytes(self, stage, mb, j):
        return M

    def link(self, src, dst):
        return Link(bandwidth=2 * M, latency=0.0, intra_node=True)


def test_a_message_is_held_from_its_send_until_received_and_from_its_receive_until_consumed():
    """pp=2, one microbatch. Rank 0: F [0,1], SEND_F at 1 (received by rank 1 at 1.5), RECV_B
    posted at 1 and completed at 5 (rank 1: F [1.5,2.5], B [2.5,4.5], SEND_B arrives at 5), B [5,7].
    At t=1 rank 0 holds the sent buffer and the posted receive: 2 messages, on top of F's A."""
    result = simulate(generate("1f1b", 2, 1, 1, 1), UnitCosts())
    r0, r1 = result.ranks
    assert result.pipeline_time_s == 7.0
    assert (r0.peak_p2p_bytes, r0.peak_recv_bytes) == (2 * M, M)
    assert r0.peak_memory_bytes == A + 2 * M + STATIC
    assert (r1.peak_p2p_bytes, r1.peak_recv_bytes) == (M, M)
    assert r1.peak_memory_bytes == A + STATIC  # its receive ends before F, its send starts as B frees A
    assert result.to_json()["ranks"][0]["peak_p2p_bytes"] == 2 * M


def test_the_third_send_on_a_link_waits_for_the_first_to_be_received():
    s = executable("1f1b", 2, 1, 4, 1)
    waits = window_waits(s)
    third = [a for a in s.ranks[0] if str(a).startswith("SEND_F")][SEND_WINDOW]
    assert str(third) == "SEND_F2.0"
    assert waits[(0, third)] == ("comm", 1, Action.parse("RECV_F0.0").kind, 1, 0, 0)
    assert (0, third) in bounded_sends(s)


def test_a_full_window_stalls_the_sender_until_the_slow_receiver_takes_the_oldest():
    """Forward only, 4 microbatches, rank 1 ten times slower: rank 0's SEND_F3 waits until rank 1
    has received microbatch 1, which it posts after F0 ends at 1.5 + 10; rank 0 holds at most
    SEND_WINDOW sent buffers at once."""
    s = executable_forward_only(executable("1f1b", 2, 1, 4, 1))
    result = simulate(s, UnitCosts(forward_s=(1.0, 10.0)))
    rank0 = [e for e in result.events if e.rank == 0 and e.stream == "send"]
    assert [e.start for e in rank0] == [1.0, 2.0, 3.0, 11.5]
    assert result.ranks[0].peak_p2p_bytes == SEND_WINDOW * M


def test_a_window_that_would_deadlock_is_released_and_the_schedule_still_runs():
    """Interleaved pp=2 v=2 with communication added in compute order (no link-ordering pass):
    both ranks send ahead of the other's receives, so some sends go unbounded; the schedule still
    validates and simulates to its end."""
    s = validate(add_communication(generate("slimpipe", 2, 2, 2, 3)))
    bounded = bounded_sends(s)
    assert set(window_waits(s)) > bounded
    assert simulate(s, UnitCosts(forward_s=(1.0, 1.0))).pipeline_time_s > 0
