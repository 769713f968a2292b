"""The context-parallel domain as nodes x ranks, and what moving bytes between its ranks costs.

Placement follows Megatron's rank order (tp fastest, then cp): CP rank ``r`` of the domain with
tensor-parallel index 0 is GPU ``r * tp``, so ``gpus_per_node / tp`` CP ranks share a node. Only
this one CP domain is modelled; the ``tp - 1`` sibling domains on the same GPUs run the same
traffic on their own GPUs.

Link classes:
* NVLink, per GPU and direction (``nvlink_bandwidth``): every intra-node transfer.
* NIC: each CP rank owns a fair share of its node's NICs, ``nic_bandwidth * min(1, nics/gpus)``
  (the share ``CostModel.link`` uses); a rank's direct inter-node transfer goes through its own
  share only. The routing layer (``routing.py``) spreads one transfer over the shares of all ranks
  of the node.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_slim.plan.cost.model import Link
from megatron_slim.plan.hardware import HardwareProfile
from megatron_slim.plan.schema import fail


@dataclass(frozen=True)
class CPTopology:
    num_ranks: int  # C: ranks of the CP domain
    ranks_per_node: int  # m: CP ranks that share a node (the last node may not be full: see check)
    nvlink: Link  # one GPU's NVLink, per direction
    nic: Link  # one CP rank's share of its node's NICs, per direction
    tp: int = 1  # stride of CP ranks in global GPU numbering

    def __post_init__(self) -> None:
        if self.num_ranks < 1:
            raise fail("parallel.cp", self.num_ranks, "an integer >= 1")
        if self.ranks_per_node < 1:
            raise fail("hardware.gpus_per_node", self.ranks_per_node, "at least parallel.tp GPUs per node")
        if self.num_ranks > self.ranks_per_node and self.num_ranks % self.ranks_per_node:
            raise fail(
                "parallel.cp",
                self.num_ranks,
                f"at most {self.ranks_per_node} or a multiple of {self.ranks_per_node} "
                "(CP ranks per node = gpus_per_node / tp), so nodes are filled evenly",
            )

    @classmethod
    def from_hardware(cls, hw: HardwareProfile, cp: int, tp: int = 1) -> "CPTopology":
        if tp < 1 or (hw.gpus_per_node % tp and tp < hw.gpus_per_node):
            raise fail("parallel.tp", tp, f"a divisor of hardware.gpus_per_node={hw.gpus_per_node}")
        per_node = max(1, hw.gpus_per_node // tp)
        share = min(1.0, hw.nics_per_node / hw.gpus_per_node)
        return cls(
            cp,
            min(per_node, cp),
            Link(hw.nvlink_bandwidth, hw.nvlink_latency, True),
            Link(hw.nic_bandwidth * share, hw.nic_latency, False),
            tp,
        )

    @classmethod
    def uniform(
        cls,
        nodes: int,
        ranks_per_node: int,
        nvlink_bandwidth: float = 200e9,
        nic_bandwidth: float = 50e9,
        nvlink_latency: float = 3e-6,
        nic_latency: float = 8e-6,
    ) -> "CPTopology":
        """A test topology: ``nodes`` full nodes of ``ranks_per_node`` ranks."""
        return cls(
            nodes * ranks_per_node,
            ranks_per_node,
            Link(nvlink_bandwidth, nvlink_latency, True),
            Link(nic_bandwidth, nic_latency, False),
        )

    # ---- placement ------------------------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        return -(-self.num_ranks // self.ranks_per_node)

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def local_index(self, rank: int) -> int:
        return rank % self.ranks_per_node

    def ranks_of_node(self, node: int) -> tuple[int, ...]:
        first = node * self.ranks_per_node
        return tuple(range(first, min(first + self.ranks_per_node, self.num_ranks)))

    def same_node(self, a: int, b: int) -> bool:
        return self.node_of(a) == self.node_of(b)

    def gpu_of(self, rank: int) -> int:
        """Global GPU index of CP rank ``rank`` (tensor-parallel index 0)."""
        return rank * self.tp

    # ---- links ----------------------------------------------------------------------------------
    def link(self, a: int, b: int) -> Link:
        return self.nvlink if self.same_node(a, b) else self.nic

    def transfer_time(self, src: int, dst: int, nbytes: float) -> float:
        """One direct transfer with nothing else on its links."""
        if src == dst or nbytes <= 0:
            return 0.0
        return self.link(src, dst).transfer_time(nbytes)

    def routed_transfer_time(self, nbytes: float) -> float:
        """An inter-node transfer split over all ``m`` ranks of the node (dispatch over NVLink,
        ``m`` NIC transfers in parallel, combine over NVLink), as the simulator plays it: the
        sender's NVLink serialises the ``m - 1`` dispatch parts, each part's NIC transfer starts
        when its dispatch lands, so the last part ends after ``(m-1)/m`` of the bytes on NVLink,
        ``1/m`` on one NIC share and ``1/m`` on the destination's NVLink."""
        if nbytes <= 0:
            return 0.0
        m = self.ranks_per_node
        if m == 1:
            return self.nic.transfer_time(nbytes)
        nv, nic = self.nvlink, self.nic
        return nbytes / nv.bandwidth + nbytes / (m * nic.bandwidth) + 2 * nv.latency + nic.latency

    def inter_hop_time(self, nbytes: float, routed: bool) -> float:
        direct = self.nic.transfer_time(nbytes) if nbytes > 0 else 0.0
        return min(direct, self.routed_transfer_time(nbytes)) if routed else direct

    def describe(self) -> str:
        return (
            f"{self.num_nodes} node(s) x {self.ranks_per_node} CP ranks; NVLink "
            f"{self.nvlink.bandwidth / 1e9:.0f} GB/s, NIC share {self.nic.bandwidth / 1e9:.0f} GB/s per rank"
        )
