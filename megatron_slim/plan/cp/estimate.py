"""What one sequence costs each rank of a split, per link class: the numbers the Zeppelin planner
decides with.

A ring of ``g`` members runs ``g`` steps per pass; every step a member computes ``s^2 / (2 g^2)``
causal pairs (zigzag makes steps equal) while the next K/V block (``s / g`` tokens) travels one
hop. The step costs ``max(compute, hop)`` except the first (own block, nothing to wait for); the
backward moves K/V and dK/dV (twice the bytes) per step plus a final dK/dV hop home. So a split
pays off once ``s / g`` is long enough for a step's quadratic compute to hide its linear hop --
about ``2 F / B`` tokens per rank for MHA in bf16 (``F`` attention FLOP/s, ``B`` link bytes/s),
which is four times longer on a NIC share than on NVLink: short sequences stay local, medium ones
split inside a node, long ones across nodes.

Hierarchical splits (all-to-all inside each node, ring across nodes) trade the inter-node ring's
``n * m`` short steps for ``n`` long ones on every rank's own NIC share, at the price of two
all-to-alls over NVLink per pass; they need the heads to divide over the node's ranks.

Estimates are per rank and pessimistic: exposed communication is charged in full, although the
attention engine fills it with other groups' and local work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, overload

from megatron_slim.plan.cp.costs import CPCosts
from megatron_slim.plan.cp.layout import GroupKind
from megatron_slim.plan.cp.topology import CPTopology


@dataclass(frozen=True)
class ZeppelinLayers:
    """Which of Zeppelin's layers the planner uses: all of them, unless an ablation switches one off."""

    remap: bool = True
    routing: bool = True
    hierarchical: bool = True
    baselines: bool = True  # also price the baseline engines' placements (choose.py)


ALL_LAYERS = ZeppelinLayers()


@dataclass(frozen=True)
class SplitOption:
    kind: GroupKind  # "local" | "zigzag" | "hierarchical"
    span: int  # ranks the sequence occupies
    nodes: int  # nodes it spans (1 unless inter-node)
    est_s: float  # forward + backward seconds per member of one layer for this sequence


def _ring(steps: int, compute_f: float, hop_f: float, compute_b: float, hop_b: float, final_b: float) -> float:
    fwd = compute_f + (steps - 1) * max(compute_f, hop_f)
    bwd = compute_b + (steps - 1) * max(compute_b, hop_b) + final_b
    return fwd + bwd


def token_time(n: float, topo: CPTopology, costs: CPCosts, remap: bool) -> float:
    """Token work a member does in the attention layout (QKV/O with remapping, the MLP too
    without)."""
    return costs.token_s(n, remap=remap)


def local_time(s: int, topo: CPTopology, costs: CPCosts, remap: bool) -> float:
    pairs = s * (s + 1) / 2
    return token_time(s, topo, costs, remap) + pairs * costs.pair_s()


def zigzag_time(s: int, g: int, topo: CPTopology, costs: CPCosts, remap: bool, *, inter: bool, routed: bool) -> float:
    if g == 1:
        return local_time(s, topo, costs, remap)
    pairs = s * s / (2 * g * g)
    block = s / g * costs.kv_bytes

    def hop(nbytes: float) -> float:
        return topo.inter_hop_time(nbytes, routed) if inter else topo.nvlink.transfer_time(nbytes)

    ring = _ring(
        g, costs.attention_s(pairs, False), hop(block), costs.attention_s(pairs, True), hop(2 * block), hop(block)
    )
    return ring + token_time(s / g, topo, costs, remap)


def hierarchical_time(s: int, nodes: int, topo: CPTopology, costs: CPCosts, remap: bool) -> float:
    m = topo.ranks_per_node
    per_rank = s / (nodes * m)
    share = (m - 1) / m
    nv = topo.nvlink

    def a2a(per_token: float) -> float:
        return nv.transfer_time(per_rank * per_token * share) if m > 1 else 0.0

    a2a_total = 2 * a2a(costs.q_bytes + costs.kv_bytes) + 2 * a2a(costs.q_bytes)
    pairs = s * s / (2 * nodes * nodes) / m
    block = s / nodes * costs.kv_bytes / m
    ring = _ring(
        nodes,
        costs.attention_s(pairs, False),
        topo.nic.transfer_time(block),
        costs.attention_s(pairs, True),
        topo.nic.transfer_time(2 * block),
        topo.nic.transfer_time(block),
    )
    return ring + a2a_total + token_time(per_rank, topo, costs, remap)


def hierarchical_allowed(topo: CPTopology, costs: CPCosts) -> bool:
    m = topo.ranks_per_node
    return m > 1 and costs.heads % m == 0


@dataclass(frozen=True)
class NodeRates:
    """Per-unit rates of local and intra-node splits, read once per pack: ``SplitOptions`` prices
    many lengths with them instead of the chain of helpers above, to the same floats (the same
    products and sums in the same order)."""

    token_s: float  # token work per token in the attention layout (``costs.token_s(1.0, ...)``)
    pair_s: float
    pair_fwd_s: float
    pair_bwd_s: float
    kv_bytes: float
    latency: float  # NVLink
    bandwidth: float

    @classmethod
    def of(cls, topo: CPTopology, costs: CPCosts, remap: bool) -> "NodeRates":
        nv = topo.nvlink
        per_token = costs.token_s(1.0, remap=remap)
        return cls(
            per_token, costs.pair_s(), costs.pair_fwd_s, costs.pair_bwd_s, costs.kv_bytes, nv.latency, nv.bandwidth
        )

    def local(self, s: int) -> float:
        """``local_time``."""
        return s * self.token_s + s * (s + 1) / 2 * self.pair_s

    def zigzag(self, s: int, g: int) -> float:
        """``zigzag_time`` inside a node, ``g > 1``."""
        pairs = s * s / (2 * g * g)
        block = s / g * self.kv_bytes
        hop = self.latency + block / self.bandwidth
        ring = _ring(
            g, pairs * self.pair_fwd_s, hop, pairs * self.pair_bwd_s, self.latency + 2 * block / self.bandwidth, hop
        )
        return ring + s / g * self.token_s


class SplitOptions(Sequence[SplitOption]):
    """``split_options`` priced on demand, in the same order: Zeppelin reads a short sequence's
    first option or two (the first that fits the target, the next when refining), so pricing all
    ``m + n - 1`` spans of every length would be most of the planner's time."""

    def __init__(
        self,
        s: int,
        topo: CPTopology,
        costs: CPCosts,
        *,
        remap: bool,
        routing: bool,
        hierarchical: bool,
        rates: NodeRates | None = None,
    ) -> None:
        """``rates``: ``NodeRates.of(topo, costs, remap)``, shared by the lengths of a pack."""
        self._s, self._topo, self._costs = s, topo, costs
        self._rates = rates
        self._remap, self._routing = remap, routing
        self._hier = hierarchical and hierarchical_allowed(topo, costs)
        self._made: list[SplitOption] = []
        self._len = topo.ranks_per_node + topo.num_nodes - 1

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, i: int) -> SplitOption: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[SplitOption]: ...
    def __getitem__(self, i: int | slice) -> SplitOption | Sequence[SplitOption]:
        if isinstance(i, slice):
            return [self[j] for j in range(len(self))[i]]
        if not 0 <= i < self._len:
            raise IndexError(i)
        while len(self._made) <= i:
            self._made.append(self._make(len(self._made)))
        return self._made[i]

    def fitting_index(self, target_s: float) -> int:
        """The index of ``choose_split(self, target_s)``, pricing only the options it reads."""
        made = self._made
        for j in range(self._len):
            if j == len(made):
                made.append(self._make(j))
            if made[j].est_s <= target_s:
                return j
        return min(range(len(self)), key=lambda j: (made[j].est_s, made[j].span))

    def _make(self, j: int) -> SplitOption:
        s, topo, costs, remap, m = self._s, self._topo, self._costs, self._remap, self._topo.ranks_per_node
        rates = self._rates
        if j == 0:
            return SplitOption("local", 1, 1, rates.local(s) if rates else local_time(s, topo, costs, remap))
        if j < m:
            intra = (
                rates.zigzag(s, j + 1)
                if rates
                else zigzag_time(s, j + 1, topo, costs, remap, inter=False, routed=False)
            )
            return SplitOption("zigzag", j + 1, 1, intra)
        k = j - m + 2
        ring = zigzag_time(s, k * m, topo, costs, remap, inter=True, routed=self._routing)
        best = SplitOption("zigzag", k * m, k, ring)
        if self._hier:
            hier = SplitOption("hierarchical", k * m, k, hierarchical_time(s, k, topo, costs, remap))
            if hier.est_s < best.est_s:
                best = hier
        return best


def split_options(
    s: int, topo: CPTopology, costs: CPCosts, *, remap: bool, routing: bool, hierarchical: bool
) -> list[SplitOption]:
    """Every placement Zeppelin considers for a sequence of ``s`` tokens, by increasing span."""
    return list(SplitOptions(s, topo, costs, remap=remap, routing=routing, hierarchical=hierarchical))


def choose_split(options: Sequence[SplitOption], target_s: float) -> SplitOption:
    """The smallest span whose per-rank cost fits the per-rank target (a fair share of the pack);
    when none fits, the cheapest per rank (ties: the smaller span)."""
    for opt in options:
        if opt.est_s <= target_s:
            return opt
    return min(options, key=lambda o: (o.est_s, o.span))
