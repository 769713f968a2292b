"""The remap's price (plan/cp/price.py ``_remap``): every rank that moves tokens waits for the
busiest mover it exchanges with, as in the simulator, where the remap all-to-all is pairwise
transfers queued on each rank's links."""

import pytest

from megatron_slim.plan.cp.assemble import GroupSpec, assemble
from megatron_slim.plan.cp.price import price_specs
from megatron_slim.plan.cp.remap import plan_remap
from megatron_slim.plan.cp.topology import CPTopology
from megatron_slim.plan.sim.cp.layer import simulate_pass


def _locals(lengths):
    return [GroupSpec("local", (r,), (r,)) for r in range(len(lengths))]


def test_movers_are_charged_the_busiest_movers_transfers(costs):
    """2 nodes x 2 ranks, share 4000: node 0 holds 7000 + 3000 (2000 beyond its share leave it),
    node 1 3000 + 3000. Rank 0 moves the most: 1500 tokens over NVLink and 1500 over its NIC,
    there and back in forward and backward; every rank waits for that."""
    topo = CPTopology.uniform(2, 2)
    lengths = (7000, 3000, 3000, 3000)
    cost = price_specs(lengths, _locals(lengths), topo, costs, remap=True)
    per_token = 4 * costs.hidden_bytes
    assert cost.intra == pytest.approx((1500 * per_token / topo.nvlink.bandwidth,) * 4, rel=1e-12)
    assert cost.inter == pytest.approx((1500 * per_token / topo.nic.bandwidth,) * 4, rel=1e-12)


def test_a_small_sender_waits_for_its_receiver(costs):
    """One node, share 4000: three ranks send 1000 tokens each to the fourth. A sender's MLP and
    its tokens' return wait for the receiver's 3000 inbound tokens: the remap costs every rank as
    much as the receiver, and the price is the simulated pass within 1%."""
    topo = CPTopology.uniform(1, 4)
    lengths = (5000, 5000, 5000, 1000)
    cost = price_specs(lengths, _locals(lengths), topo, costs, remap=True)
    assert cost.intra[0] == pytest.approx(3000 * 4 * costs.hidden_bytes / topo.nvlink.bandwidth, rel=1e-12)
    plan = assemble("zeppelin", lengths, topo, _locals(lengths), "zeppelin")
    remap = plan_remap(plan.tokens_per_rank(), topo)
    simulated = sum(simulate_pass(plan, topo, costs, backward=b, remap=remap).time_s for b in (False, True))
    assert cost.time_s == pytest.approx(simulated, rel=0.01)
