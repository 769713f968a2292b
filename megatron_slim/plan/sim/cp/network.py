"""Transfers, routed transfers and collectives as comm tasks on the CP topology's resources.

* point to point inside a node: the sender's NVLink out and the receiver's NVLink in;
  between nodes: the sender's NIC share out and the receiver's NIC share in (GPUDirect RDMA, the
  PCIe hop is not modelled).
* routed (``routing.Route``): per part a dispatch (NVLink), the NIC transfer between proxies, a
  combine (NVLink), chained; the transfer is done when every part has arrived.
* all-to-all: the sum of its point-to-point flows, as one task (participants synchronise).
* all-gather / reduce-scatter: NCCL's bandwidth-optimal hierarchical pattern -- each node's data
  crosses the network once per other node, spread over the node's NIC shares, and is then
  forwarded over NVLink -- with ring latencies (one per node and one per rank hop).
"""

from __future__ import annotations

from typing import Iterable

from megatron_slim.plan.cp.routing import Route
from megatron_slim.plan.cp.topology import CPTopology
from megatron_slim.plan.sim.cp.events import Deps, Resource, TaskGraph


class Network:
    def __init__(self, topo: CPTopology, graph: TaskGraph) -> None:
        self.topo = topo
        self.graph = graph
        self.sent = [{"intra": 0.0, "inter": 0.0} for _ in range(topo.num_ranks)]

    def _flow(self, loads: dict[Resource, float], src: int, dst: int, nbytes: float) -> float:
        """Add one flow's loads; return its latency."""
        if src == dst or nbytes <= 0:
            return 0.0
        topo = self.topo
        if topo.same_node(src, dst):
            sec = nbytes / topo.nvlink.bandwidth
            out, inn, lat, cls = "nvl_out", "nvl_in", topo.nvlink.latency, "intra"
        else:
            sec = nbytes / topo.nic.bandwidth
            out, inn, lat, cls = "nic_out", "nic_in", topo.nic.latency, "inter"
        loads[(out, src)] = loads.get((out, src), 0.0) + sec
        loads[(inn, dst)] = loads.get((inn, dst), 0.0) + sec
        self.sent[src][cls] += nbytes
        return lat

    def transfer(self, src: int, dst: int, nbytes: float, deps: Deps, name: str = "", detail: str = "") -> int:
        loads: dict[Resource, float] = {}
        lat = self._flow(loads, src, dst, nbytes)
        return self.graph.comm(loads, lat, deps, name, detail)

    def routed(self, route: Route, bytes_per_row: float, deps: Deps, name: str = "", detail: str = "") -> int:
        """Every part's legs are named ``name``; ``detail`` says which part and leg."""
        ends: list[int] = []
        for k, part in enumerate(route.parts):
            nbytes = part.size * bytes_per_row
            prev = tuple(deps)
            part_of = f"{detail + ', ' if detail else ''}routed part {k}"
            if part.proxy_src != route.src:
                prev = (self.transfer(route.src, part.proxy_src, nbytes, prev, name, f"{part_of} dispatch"),)
            prev = (self.transfer(part.proxy_src, part.proxy_dst, nbytes, prev, name, part_of),)
            if part.proxy_dst != route.dst:
                prev = (self.transfer(part.proxy_dst, route.dst, nbytes, prev, name, f"{part_of} combine"),)
            ends.extend(prev)
        return self.join(ends or deps)

    def join(self, deps: Deps) -> int:
        return self.graph.comm({}, 0.0, deps)

    def all_to_all(self, flows: Iterable[tuple[int, int, float]], deps: Deps, name: str = "", detail: str = "") -> int:
        """``flows``: (src, dst, bytes) triples of one collective."""
        loads: dict[Resource, float] = {}
        lat = 0.0
        for src, dst, nbytes in flows:
            lat = max(lat, self._flow(loads, src, dst, nbytes))
        return self.graph.comm(loads, lat, deps, name, detail)

    def all_gather(self, members: tuple[int, ...], block_bytes: list[float], deps: Deps, name: str = "") -> int:
        """Every member ends with every member's block (also the cost of the mirror-image
        reduce-scatter)."""
        topo = self.topo
        by_node: dict[int, list[int]] = {}
        for i, r in enumerate(members):
            by_node.setdefault(topo.node_of(r), []).append(i)
        total = sum(block_bytes)
        n = len(by_node)
        loads: dict[Resource, float] = {}
        nv, nic = topo.nvlink.bandwidth, topo.nic.bandwidth

        def add(res: Resource, nbytes: float) -> None:
            if nbytes > 0:
                loads[res] = loads.get(res, 0.0) + nbytes / (nv if res[0].startswith("nvl") else nic)

        for idx in by_node.values():
            m = len(idx)
            node_total = sum(block_bytes[i] for i in idx)
            remote = total - node_total
            for i in idx:
                r, own = members[i], block_bytes[i]
                add(("nic_out", r), node_total * (n - 1) / m)
                add(("nic_in", r), remote / m)
                add(("nvl_in", r), (total - own) - remote / m)
                add(("nvl_out", r), own * (m - 1) + remote / m * (m - 1))
                self.sent[r]["inter"] += node_total * (n - 1) / m
                self.sent[r]["intra"] += own * (m - 1) + remote / m * (m - 1)
        per_node = max(len(v) for v in by_node.values())
        lat = (n - 1) * topo.nic.latency + (per_node - 1) * topo.nvlink.latency
        return self.graph.comm(loads, lat, deps, name)
