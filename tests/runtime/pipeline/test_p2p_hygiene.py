"""Point-to-point hygiene over gloo: a sent slice's storage is freed once its transfer completes,
long before the step ends (at most ``SEND_WINDOW`` sends are outstanding per link), and the
activation meter's count of in-flight receive buffers equals the simulator's on the same plan, and
receives are posted ahead of their RECV, where the plan places them."""

import pytest

from megatron_slim.plan.schedule.executable import executable
from megatron_slim.plan.schedule.ir import Kind
from megatron_slim.plan.schedule.recv_posts import posted_before
from megatron_slim.plan.schedule.walk import SEND_WINDOW
from megatron_slim.plan.sim.engine import simulate
from megatron_slim.runtime.spawn import run_ranks
from tests.plan.test_simulator_in_flight import UnitCosts
from tests.runtime.pipeline import _p2p_workers

CONFIGS = [("slimpipe", 1, 2, 4), ("slimpipe", 2, 2, 3)]  # kind, vpp, microbatches, slices


class MessageCosts(UnitCosts):
    def p2p_bytes(self, stage, mb, j):
        return _p2p_workers.MESSAGE_BYTES


@pytest.fixture(scope="module", params=CONFIGS, ids=lambda c: "-".join(map(str, c)))
def ranks(request):
    return request.param, run_ranks(_p2p_workers.run, 2, *request.param, timeout_s=600)


def test_a_sent_slices_storage_is_freed_before_the_step_ends(ranks):
    """Rank 0 sends every slice of every microbatch (8 or more) during its forwards; before the
    window, all of them stayed alive until the step's end (``wait_all``)."""
    _, results = ranks
    first = results[0]
    assert first["sends"] > SEND_WINDOW + 2
    assert len(first["alive_at_forward"]) > SEND_WINDOW + 2
    assert max(first["alive_at_forward"]) <= SEND_WINDOW
    for r in results:
        assert r["alive_after"] == 0 and r["live_p2p_bytes"] == 0
        assert r["grad"].abs().sum() > 0


def test_in_flight_receive_bytes_equal_the_simulators(ranks):
    (kind, vpp, m, n), results = ranks
    simulated = simulate(executable(kind, 2, vpp, m, n), MessageCosts()).ranks
    for r, (measured, model) in enumerate(zip(results, simulated)):
        assert measured["peak_recv_bytes"] == model.peak_recv_bytes > 0, r
        # send buffers: at most the window on the rank's one outgoing link, on both sides
        assert model.peak_p2p_bytes <= model.peak_recv_bytes + SEND_WINDOW * _p2p_workers.MESSAGE_BYTES
        assert measured["peak_p2p_bytes"] <= measured["peak_recv_bytes"] + SEND_WINDOW * _p2p_workers.MESSAGE_BYTES


def test_receives_are_posted_ahead_as_the_plan_says(ranks):
    """Every receive the plan posts ahead of its RECV was found posted when the RECV came."""
    (kind, vpp, m, n), results = ranks
    schedule = executable(kind, 2, vpp, m, n)
    for r, measured in enumerate(results):
        before = posted_before(schedule, r)
        planned = sum(before[a] != a for a in schedule.ranks[r] if a.kind in (Kind.RECV_F, Kind.RECV_B))
        assert measured["posted_ahead"] == planned > 0, r
