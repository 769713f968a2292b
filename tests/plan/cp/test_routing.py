import pytest

from megatron_slim.plan.cp.engines import plan_pack
from megatron_slim.plan.cp.routing import plan_routing, route_transfer
from megatron_slim.plan.cp.topology import CPTopology

from .conftest import packs, topology


def check_route(route, topo):
    assert sum(p.size for p in route.parts) == route.size  # conserved
    pos = 0
    for p in route.parts:
        assert p.start == pos and p.end > p.start
        pos = p.end
        assert topo.same_node(p.proxy_src, route.src) and topo.same_node(p.proxy_dst, route.dst)
    if route.routed:
        assert len({p.proxy_src for p in route.parts}) == len(route.parts)  # one NIC each
        assert all(topo.local_index(p.proxy_src) == topo.local_index(p.proxy_dst) for p in route.parts)
        moved_in = sum(n for _, _, n in route.dispatches()) + sum(
            p.size for p in route.parts if p.proxy_src == route.src
        )
        assert moved_in == route.size
        assert (
            sum(n for _, _, n in route.combines()) + sum(p.size for p in route.parts if p.proxy_dst == route.dst)
            == route.size
        )


@pytest.mark.parametrize("size", [1, 7, 8, 1000, 12345])
def test_routed_transfer_splits_over_every_nic_and_conserves_rows(size):
    topo = topology("4x8")
    route = route_transfer(topo, 5, 17, size, bytes_per_row=16384)
    check_route(route, topo)
    if size >= 1000:
        assert route.routed and len(route.parts) == 8
        sizes = [p.size for p in route.parts]
        assert max(sizes) - min(sizes) <= 1


def test_small_or_intra_node_transfers_go_direct():
    topo = topology("4x8")
    assert not route_transfer(topo, 0, 1, 10**6, 16384).routed  # same node
    assert not route_transfer(topo, 0, 9, 1, 16).routed  # 16 bytes: latency dominates
    assert topo.routed_transfer_time(1e9) < topo.nic.transfer_time(1e9)


def test_routing_plan_covers_every_inter_node_hop_of_routed_groups(costs):
    topo = CPTopology.uniform(2, 4)
    routed_groups = 0
    mixed, odd, tiny, huge = packs(seed=2, count=4, total=200_000)
    tiny = packs(seed=2, count=3)[2]  # thousands of sequences of 1..40 tokens cost the planner most
    for lengths in (mixed, odd, tiny, huge, (120_001,)):
        plan = plan_pack("zeppelin", lengths, topo, costs)
        routing = plan_routing(plan, topo, costs.kv_bytes)
        expected = 0
        for g in plan.groups:
            routed_groups += g.routed
            if g.routed:
                hops = sum(1 for i, r in enumerate(g.ranks) if not topo.same_node(g.ranks[i - 1], r))
                expected += hops * len(g.ranks)  # steps 1..g-1 plus the gradient's way home
        assert len(routing.hops) == expected
        for hop in routing.hops:
            check_route(hop.route, topo)
            g = plan.groups[hop.group]
            i = g.ranks.index(hop.route.dst)
            assert hop.route.size == plan.group_tokens(g.index, g.ranks[(i - hop.step) % len(g.ranks)])
            assert routing.route_for(hop.group, hop.step, hop.route.dst) == hop.route
    assert routed_groups > 0
