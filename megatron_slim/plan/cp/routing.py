"""Zeppelin's routing layer: one inter-node transfer spread over every NIC of the node.

A ring hop from ``src`` (node A) to ``dst`` (node B) sends a message of ``size`` rows (K/V tokens;
bytes are rows x bytes per row). Without routing it uses only ``src``'s NIC. Routed, the rows are
cut into one contiguous part per rank of node A (local index order, sizes differing by at most
one): part ``l`` goes (1) over NVLink from ``src`` to proxy ``A[l]`` (nothing to do when the proxy
is ``src``), (2) over ``A[l]``'s NIC to ``B[l]`` (the same local index: rail-aligned), (3) over
NVLink from ``B[l]`` to ``dst`` (nothing when it is ``dst``). A hop is routed only when the
topology's estimate says routing is faster for its bytes (small messages go direct).

``plan_routing`` lists every inter-node hop of a plan's routed zigzag groups for every ring step
``1 .. g-1`` (the backward's K/V and dK/dV messages reuse the same parts) and for step ``g``, the
backward's last hop that returns each block's dK/dV to its owner, so the simulator and the runtime
read the same parts.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_slim.plan.cp.layout import CPPlan
from megatron_slim.plan.cp.topology import CPTopology
from megatron_slim.plan.cp.zigzag import chunk_bounds


@dataclass(frozen=True)
class RoutePart:
    proxy_src: int  # rank on the source node whose NIC carries the part
    proxy_dst: int  # rank on the destination node that receives it
    start: int  # rows [start, end) of the message
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Route:
    src: int
    dst: int
    size: int
    parts: tuple[RoutePart, ...]  # one part (src -> dst) when not routed

    @property
    def routed(self) -> bool:
        return len(self.parts) > 1 or (bool(self.parts) and self.parts[0].proxy_src != self.src)

    def dispatches(self) -> tuple[tuple[int, int, int], ...]:
        """(from, to, rows) of the intra-node steps before the NICs."""
        return tuple((self.src, p.proxy_src, p.size) for p in self.parts if p.proxy_src != self.src)

    def combines(self) -> tuple[tuple[int, int, int], ...]:
        return tuple((p.proxy_dst, self.dst, p.size) for p in self.parts if p.proxy_dst != self.dst)


@dataclass(frozen=True)
class RoutedHop:
    group: int
    step: int  # ring step whose block this hop delivers (1 .. g-1); g: backward dK/dV home hop
    route: Route


@dataclass(frozen=True)
class RoutingPlan:
    hops: tuple[RoutedHop, ...]

    def route_for(self, group: int, step: int, dst: int) -> Route | None:
        return self._index().get((group, step, dst))

    def _index(self) -> dict[tuple[int, int, int], Route]:
        cache: dict[tuple[int, int, int], Route] | None = self.__dict__.get("_cache")
        if cache is None:
            cache = {(h.group, h.step, h.route.dst): h.route for h in self.hops}
            object.__setattr__(self, "_cache", cache)
        return cache


def direct(src: int, dst: int, size: int) -> Route:
    return Route(src, dst, size, (RoutePart(src, dst, 0, size),) if size else ())


def route_transfer(topo: CPTopology, src: int, dst: int, size: int, bytes_per_row: float = 1.0) -> Route:
    """Route ``size`` rows from ``src`` to ``dst``; direct when intra-node or not worth it."""
    if topo.same_node(src, dst) or size == 0:
        return direct(src, dst, size)
    nbytes = size * bytes_per_row
    if topo.routed_transfer_time(nbytes) >= topo.nic.transfer_time(nbytes):
        return direct(src, dst, size)
    src_ranks = topo.ranks_of_node(topo.node_of(src))
    dst_ranks = topo.ranks_of_node(topo.node_of(dst))
    ways = min(len(src_ranks), len(dst_ranks))
    b = chunk_bounds(size, ways)
    parts = tuple(RoutePart(src_ranks[w], dst_ranks[w], b[w], b[w + 1]) for w in range(ways) if b[w + 1] > b[w])
    return Route(src, dst, size, parts)


def plan_routing(plan: CPPlan, topo: CPTopology, bytes_per_row: float) -> RoutingPlan:
    """Routes for every inter-node hop of the plan's routed groups, step by step."""
    hops = []
    for g in plan.groups:
        if not g.routed or g.kind != "zigzag":
            continue
        ring = len(g.ranks)
        blocks = [plan.group_tokens(g.index, r) for r in g.ranks]
        for step in range(1, ring + 1):
            for i, dst in enumerate(g.ranks):
                src = g.ranks[(i - 1) % ring]
                if topo.same_node(src, dst):
                    continue
                size = blocks[(i - step) % ring]  # the block of member i - step arrives at member i
                hops.append(RoutedHop(g.index, step, route_transfer(topo, src, dst, size, bytes_per_row)))
    return RoutingPlan(tuple(hops))
