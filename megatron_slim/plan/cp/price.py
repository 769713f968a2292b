"""One cost model for any placement of a pack: what Zeppelin's planner scores its candidates with.

A placement is a list of ``GroupSpec``s (Zeppelin's own or a baseline engine's). ``price_specs``
returns, per rank, the seconds of one layer's forward + backward split into

* ``compute``: attention pairs plus the token work (QKV/O in the attention layout, the MLP in the
  balanced layout when remapping, else in the attention layout);
* ``intra`` / ``inter``: communication the rank waits for on NVLink / on a NIC: ring hops a ring
  step's compute does not hide (``estimate._ring``), the head all-to-alls of ``ulysses`` and
  ``hierarchical`` groups, the K/V all-gather, and the remap's all-to-alls (every rank that moves
  tokens waits for the busiest mover it exchanges with: ``_remap``);
* ``wait``: how much later its attention ends because a partner in one of its groups reaches
  that group late (busy with groups of a higher priority or more token work first: ``_waits``);

and the pack time, the busiest rank's sum (``idle`` = time - own work, ``wait`` included). Each
rank's groups are charged one after the other, so the model is pessimistic for ranks in many
groups (the attention engine fills one group's waits with another's work) and exact in structure
for one-group placements.
Only counts of tokens and pairs are used (no segment is built), so pricing a candidate is cheap
next to assembling it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from megatron_slim.plan.cp.assemble import GroupSpec
from megatron_slim.plan.cp.costs import CPCosts
from megatron_slim.plan.cp.estimate import _ring
from megatron_slim.plan.cp.topology import CPTopology

COMPONENTS = ("compute", "intra", "inter", "idle")


@dataclass(frozen=True)
class PackCost:
    """Estimated seconds of one layer (forward + backward) of one pack, per rank and component."""

    compute: tuple[float, ...]
    intra: tuple[float, ...]
    inter: tuple[float, ...]
    wait: tuple[float, ...]  # for the partners of its groups (``_waits``), not work of its own

    def load(self, rank: int) -> float:
        return self.compute[rank] + self.intra[rank] + self.inter[rank] + self.wait[rank]

    @cached_property
    def time_s(self) -> float:
        return max([c + a + e + w for c, a, e, w in zip(self.compute, self.intra, self.inter, self.wait)])

    def breakdown(self) -> dict[str, float]:
        """Mean over ranks of each component; they sum to ``time_s`` (``idle`` includes ``wait``)."""
        n = len(self.compute)
        mean = {k: sum(getattr(self, k)) / n for k in COMPONENTS[:3]}
        mean["idle"] = self.time_s - sum(mean.values())
        return mean


_Own = tuple[float, float]  # what a group's kind returns: each member's compute, and its span
_Coupled = tuple[tuple[int, ...], float, float]  # a group's members, each one's compute and span


class _Loads:
    def __init__(self, n: int) -> None:
        self.compute = [0.0] * n
        self.intra = [0.0] * n
        self.inter = [0.0] * n
        self.tokens = [0.0] * n

    def comm(self, rank: int, seconds: float, inter: bool) -> None:
        (self.inter if inter else self.intra)[rank] += seconds

    def charge(
        self, ranks: tuple[int, ...], compute: float, comm: float, inter: bool, tokens: float, intra_s: float = 0.0
    ) -> None:
        """Every member of a group: ``compute``, ``comm`` on its link class, ``tokens``, and, when
        ``intra_s`` is given, NVLink time charged after ``comm`` (a hierarchical group's
        all-to-alls)."""
        link = self.inter if inter else self.intra
        for r in ranks:
            self.compute[r] += compute
            link[r] += comm
            if intra_s:
                self.intra[r] += intra_s
            self.tokens[r] += tokens


def _spans_nodes(ranks: tuple[int, ...], topo: CPTopology) -> bool:
    return topo.node_of(min(ranks)) != topo.node_of(max(ranks))  # nodes are rank ranges


def _zigzag(spec: GroupSpec, lens: list[int], topo: CPTopology, costs: CPCosts, loads: _Loads) -> _Own:
    g = len(spec.ranks)
    total, squares = sum(lens), sum(s * s for s in lens)
    inter = _spans_nodes(spec.ranks, topo)
    block = total / g * costs.kv_bytes

    def hop(nbytes: float) -> float:
        return topo.inter_hop_time(nbytes, spec.routed) if inter else topo.nvlink.transfer_time(nbytes)

    pairs = squares / (2 * g * g)
    cf, cb = costs.attention_s(pairs, False), costs.attention_s(pairs, True)
    ring = _ring(g, cf, hop(block), cb, hop(2 * block), hop(block))
    loads.charge(spec.ranks, g * (cf + cb), ring - g * (cf + cb), inter, total / g)
    return g * (cf + cb), ring


def _hierarchical(spec: GroupSpec, lens: list[int], topo: CPTopology, costs: CPCosts, loads: _Loads) -> _Own:
    a = spec.a2a_size
    n = len(spec.ranks) // a
    total, squares = sum(lens), sum(s * s for s in lens)
    per_rank = total / (n * a)
    kv_share = max(1.0 / a, 1.0 / costs.kv_heads)
    qkv = costs.q_bytes + costs.kv_bytes * kv_share * a
    a2a = 4 * topo.nvlink.latency + 2 * (qkv + costs.q_bytes) * per_rank * (a - 1) / a / topo.nvlink.bandwidth
    pairs = squares / (2 * n * n * a)
    block = total / n * costs.kv_bytes * kv_share
    cf, cb = costs.attention_s(pairs, False), costs.attention_s(pairs, True)
    nic = topo.nic
    ring = _ring(n, cf, nic.transfer_time(block), cb, nic.transfer_time(2 * block), nic.transfer_time(block))
    loads.charge(spec.ranks, n * (cf + cb), ring - n * (cf + cb), True, per_rank, intra_s=a2a)
    return n * (cf + cb), ring + a2a


def _ulysses(spec: GroupSpec, lens: list[int], topo: CPTopology, costs: CPCosts, loads: _Loads) -> _Own:
    p = len(spec.ranks)
    rows = sum(lens) / p
    kv_share = max(1.0 / p, 1.0 / costs.kv_heads)
    per_peer = rows * (4 * costs.q_bytes / p + 2 * costs.kv_bytes * kv_share)  # the 4 all-to-alls
    compute = sum(s * (s + 1) / 2 for s in lens) / p * costs.pair_s()
    slowest = 0.0
    for r in spec.ranks:
        same = sum(1 for x in spec.ranks if topo.same_node(x, r))
        nvl = per_peer * (same - 1) / topo.nvlink.bandwidth + 4 * topo.nvlink.latency
        nic = per_peer * (p - same) / topo.nic.bandwidth + (4 * topo.nic.latency if p > same else 0.0)
        loads.compute[r] += compute
        loads.comm(r, max(nvl, nic), nic > nvl)
        loads.tokens[r] += rows
        slowest = max(slowest, nvl, nic)
    return compute, compute + slowest


def _allgather(spec: GroupSpec, lens: list[int], topo: CPTopology, costs: CPCosts, loads: _Loads) -> _Own:
    g = len(spec.ranks)
    total = sum(lens)
    own = total / g * costs.kv_bytes
    nodes = len({topo.node_of(r) for r in spec.ranks})
    m = g // nodes
    nic = own * (nodes - 1) / topo.nic.bandwidth
    nvl = (own * (g - 1) - own * (nodes - 1)) / topo.nvlink.bandwidth
    lat = (nodes - 1) * topo.nic.latency + (m - 1) * topo.nvlink.latency
    collective = max(nic, nvl) + lat  # forward: one gather; backward: gather and reduce-scatter
    compute = sum(s * (s + 1) / 2 for s in lens) / g * costs.pair_s()
    loads.charge(spec.ranks, compute, 3 * collective, nodes > 1 and nic >= nvl, total / g)
    return compute, compute + 3 * collective


def _local(spec: GroupSpec, lens: list[int], topo: CPTopology, costs: CPCosts, loads: _Loads) -> _Own:
    r = spec.ranks[0]
    loads.compute[r] += sum(s * (s + 1) / 2 for s in lens) * costs.pair_s()
    loads.tokens[r] += sum(lens)
    return 0.0, 0.0  # waits for no one


_KINDS = {"local": _local, "zigzag": _zigzag, "hierarchical": _hierarchical, "ulysses": _ulysses}
_KINDS["allgather"] = _allgather


def _remap(loads: _Loads, topo: CPTopology, costs: CPCosts) -> None:
    """The remap all-to-alls (there and back, forward and backward) of every rank whose
    attention-layout tokens differ from the balanced share; the part of a node's surplus or deficit
    that the node cannot settle inside crosses a NIC.

    A rank waits for its partners' transfers, not only its own: its MLP needs every token bound for
    it, and its own tokens come back only once their receiver's MLP is done (the simulator runs the
    all-to-all as pairwise transfers that queue on each rank's links). So every rank that moves
    tokens is charged the remap time of the busiest mover it exchanges with: the movers of its node,
    and, where its node settles a surplus or deficit across the network, the movers of every node
    that does. Charging each rank its own transfers only put the remap 1 ms a layer below the
    simulator on average (hopper-cudnn calibration, 32 ranks) and picked it where it lost."""
    share = sum(loads.tokens) / len(loads.tokens)
    per_hidden = 4 * costs.hidden_bytes
    own: dict[int, tuple[float, float]] = {}  # mover -> (NVLink s, NIC s)
    groups: dict[int, list[int]] = {}  # component (-1: across nodes) -> movers
    for node in range(topo.num_nodes):
        ranks = topo.ranks_of_node(node)
        gaps = [loads.tokens[r] - share for r in ranks]
        moved = sum(map(abs, gaps))
        net = abs(sum(gaps))
        for r, gap in zip(ranks, gaps):
            if not gap:
                continue
            off_node = abs(gap) * net / moved
            own[r] = (
                (abs(gap) - off_node) * per_hidden / topo.nvlink.bandwidth,
                off_node * per_hidden / topo.nic.bandwidth,
            )
            groups.setdefault(-1 if net > 1e-9 * moved else node, []).append(r)
    for movers in groups.values():
        intra, inter = max((own[r] for r in movers), key=sum)
        for r in movers:
            loads.intra[r] += intra
            loads.inter[r] += inter


def price_group(lengths: tuple[int, ...], spec: GroupSpec, topo: CPTopology, costs: CPCosts) -> float:
    """What one group charges its ranks (compute + communication, no token work), summed over
    them and divided by every rank of ``topo``: its share of a placement's mean rank load."""
    loads = _Loads(topo.num_ranks)
    _KINDS[spec.kind](spec, [lengths[i] for i in spec.seqs], topo, costs, loads)
    return (sum(loads.compute) + sum(loads.intra) + sum(loads.inter)) / topo.num_ranks


def price_specs(
    lengths: tuple[int, ...], specs: list[GroupSpec], topo: CPTopology, costs: CPCosts, *, remap: bool
) -> PackCost:
    return price_both(lengths, specs, topo, costs, (remap,))[0]


def price_both(
    lengths: tuple[int, ...], specs: list[GroupSpec], topo: CPTopology, costs: CPCosts, remaps: tuple[bool, ...]
) -> tuple[PackCost, ...]:
    """``price_specs`` of one placement under each of ``remaps``: the groups are charged once."""
    groups = _Loads(topo.num_ranks)
    pair_s = costs.pair_s()
    coupled: tuple[list[_Coupled], list[_Coupled]] = ([], [])  # inter-node groups, then intra-node ones
    for spec in specs:
        if spec.kind == "local" and len(spec.seqs) == 1:  # most groups: ``_local`` of one sequence
            s, r = lengths[spec.seqs[0]], spec.ranks[0]
            groups.compute[r] += s * (s + 1) / 2 * pair_s
            groups.tokens[r] += s
            continue
        work, span = _KINDS[spec.kind](spec, [lengths[i] for i in spec.seqs], topo, costs, groups)
        if len(spec.ranks) > 1:
            coupled[0 if _spans_nodes(spec.ranks, topo) else 1].append((spec.ranks, work, span))
    queue = coupled[0] + coupled[1]  # the attention engine's queue order (plan.cp.assemble)
    attn_token_s = costs.token_s(1.0, remap=True)
    mlp_s = costs.mlp_fwd_s + costs.mlp_bwd_s
    before_s = costs.pre_fwd_s + costs.post_bwd_s  # token work ahead of attention, forward + backward
    share = sum(lengths) / topo.num_ranks
    out = []
    for remap in remaps:
        loads = _Loads(0)
        loads.intra, loads.inter, loads.tokens = list(groups.intra), list(groups.inter), groups.tokens
        loads.compute = [
            c + t * attn_token_s + (share if remap else t) * mlp_s for c, t in zip(groups.compute, groups.tokens)
        ]
        ahead = (before_s, share * costs.mlp_bwd_s) if remap else (before_s + costs.mlp_bwd_s, 0.0)
        wait = _waits(queue, ahead, groups) if queue else (0.0,) * topo.num_ranks
        if remap:
            _remap(loads, topo, costs)
        out.append(PackCost(tuple(loads.compute), tuple(loads.intra), tuple(loads.inter), wait))
    return tuple(out)


def _waits(queue: list[_Coupled], ahead: tuple[float, float], groups: _Loads) -> tuple[float, ...]:
    """Per rank, how long its attention ends after its own work would: a group's members run it
    together (ring steps hand K/V along, all-to-alls synchronise), so it ends its span after its
    *last* member turns to it, and a member turns to a group once the work it queues first is done:
    the token work ahead of attention (``ahead``: seconds per token and per rank) and the compute
    of its groups of a higher priority (their exposed communication overlaps the next group's
    compute). A member that waits fills the gap with work of a lower priority (intra-node rings,
    local sequences), but not with the MLP, which needs its attention output. Without this a rank
    of one group over every rank beside a group over most of them was priced as if alone (uniform
    16K-128K, seed 0: ranks outside the second group wait 3 ms a layer; docs/cp-placement-choice.md)."""
    per_token, fixed = ahead
    tokens, compute, intra, inter = groups.tokens, groups.compute, groups.intra, groups.inter
    before = [t * per_token + fixed for t in tokens]
    ready = before[:]  # a member's own work queued so far, waits left out (they are filled)
    ends = [0.0] * len(tokens)
    for members, work, span in queue:
        end = max([ready[r] for r in members]) + span
        for r in members:
            ready[r] += work
            if end > ends[r]:
                ends[r] = end
    own = [b + c + a + e for b, c, a, e in zip(before, compute, intra, inter)]
    return tuple([end - o if end > o else 0.0 for end, o in zip(ends, own)])
