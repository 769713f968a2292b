"""Task graphs of one attention pass (forward or backward) for every group kind of a ``CPPlan``.

Ring groups (``zigzag``, and the per-local-index rings of ``hierarchical``), member ``i``:
* step 0 computes its own block; step ``t >= 1`` computes the block of member ``i - t``, which
  arrives from member ``i - 1``. A hop starts when the sender holds the block (step 1: its own,
  ready once its QKV projection / output gradient exists) and when the receiver's double buffer is
  free (its compute of step ``t - 2`` is done). Compute of step ``t`` waits for its hop and for
  step ``t - 1`` (the softmax merge is sequential).
* backward: the K/V hop as above plus a dK/dV hop carrying the block's gradient accumulated so
  far, which leaves once the sender's step ``t - 1`` kernel is done and its own incoming
  accumulator has arrived. As in ring flash-attention, a step's kernel does not wait for the
  incoming dK/dV (only the cheap accumulation does), so that hop overlaps the next kernel. After
  the last step the gradient goes one more hop to its owner. Backward compute is ``CPCosts.pair_bwd_s`` per
  pair (2.5x the forward FLOPs at the backward kernel efficiency).
* routed groups send inter-node hops through the routing plan's parts.

``hierarchical``: all-to-all of Q/K/V inside each node, ``a2a_size`` rings over the nodes (one per
local index, each on its members' own NIC shares, computing ``1 / a2a_size`` of the heads), then
an all-to-all of the outputs (backward: dO in, dQ/dK/dV out). ``ulysses``: one all-to-all over
all members, full-sequence attention on ``1 / C`` of the heads, one back. ``allgather``: all-gather
of K/V, then each member's zigzag queries against their whole prefix (backward: all-gather again,
reduce-scatter of dK/dV). ``local``: one task per sequence.
"""
from __future__ import annotations

from typing import Callable

from megatron_slim.plan.cp.costs import CPCosts
from megatron_slim.plan.cp.layout import CPGroup, CPPlan
from megatron_slim.plan.cp.routing import RoutingPlan
from megatron_slim.plan.cp.zigzag import causal, chunk_bounds, member_prefix_pairs
from megatron_slim.plan.sim.cp_events import Deps, Priority
from megatron_slim.plan.sim.cp_network import Network


def ring_pairs(lengths: list[int], ring: int) -> list[list[int]]:
    """``pairs[i][j]``: causal pairs member ``i`` computes with the block of member ``j``."""
    pairs = [[0] * ring for _ in range(ring)]
    for s in lengths:
        b = chunk_bounds(s, 2 * ring)
        n = [b[k + 1] - b[k] for k in range(2 * ring)]
        for i in range(ring):
            a, z = n[i], n[2 * ring - 1 - i]
            row = pairs[i]
            row[i] += causal(a) + causal(z) + z * a
            for j in range(i):
                row[j] += (a + z) * n[j]
            for j in range(i + 1, ring):
                row[j] += z * (n[j] + n[2 * ring - 1 - j])
    return pairs


class AttentionBuilder:
    def __init__(self, plan: CPPlan, costs: CPCosts, net: Network, routing: RoutingPlan | None,
                 backward: bool) -> None:
        self.plan, self.costs, self.net, self.routing, self.backward = plan, costs, net, routing, backward
        self.graph = net.graph

    def _attn(self, rank: int, pairs: float, deps: Deps, priority: Priority, name: str) -> int:
        return self.graph.compute(rank, self.costs.attention_s(pairs, self.backward), deps, priority, name=name)

    def build(self, group: CPGroup, ready: dict[int, int]) -> dict[int, list[int]]:
        """Tasks of ``group``; ``ready[rank]`` is the task after which a member may start.
        Returns, per member, the tasks its post-attention work must wait for."""
        kind = group.kind
        if kind == "local":
            return self._local(group, ready)
        if kind == "zigzag":
            return self._ring(group, list(group.ranks), [self.plan.lengths[i] for i in group.seqs], ready,
                              [self.plan.group_tokens(group.index, r) for r in group.ranks], 1.0, 1.0, 0)
        if kind == "hierarchical":
            return self._hierarchical(group, ready)
        if kind == "ulysses":
            return self._ulysses(group, ready)
        return self._allgather(group, ready)

    # ---- kinds ------------------------------------------------------------------------------------
    def _local(self, group: CPGroup, ready: dict[int, int]) -> dict[int, list[int]]:
        rank = group.ranks[0]
        return {rank: [self._attn(rank, causal(self.plan.lengths[i]), (ready[rank],), (group.priority, group.index, k),
                                  f"local seq {i} ({self.plan.lengths[i]} tokens)")
                       for k, i in enumerate(group.seqs)]}

    def _hop(self, group: CPGroup, step: int, src: int, dst: int, rows: float, per_row: float, deps: Deps,
             name: str = "") -> int:
        route = self.routing.route_for(group.index, step, dst) if (self.routing and group.routed) else None
        if route is not None and route.routed:
            return self.net.routed(route, per_row, deps, f"{name} routed" if name else "")
        return self.net.transfer(src, dst, rows * per_row, deps, name)

    def _ring(self, group: CPGroup, ranks: list[int], lengths: list[int], ready: dict[int, int],
              block_rows: list[float], head_share: float, kv_share: float, sub: int) -> dict[int, list[int]]:
        g = len(ranks)
        pairs = ring_pairs(lengths, g)
        kvb = self.costs.kv_bytes * kv_share
        prio = (group.priority, group.index)
        tag = f"{group.kind} g{group.index}" + (f" ring {sub}" if group.kind == "hierarchical" else "")
        comp = [[0] * g for _ in range(g)]
        kv_hop = [[0] * g for _ in range(g)]
        dkv_hop = [[0] * g for _ in range(g)]

        def grad_ready(i: int, t: int) -> tuple[int, ...]:
            """Member i's accumulated dK/dV of the block it computed at step t can leave."""
            return (comp[i][t],) + ((dkv_hop[i][t],) if t >= 1 else ())

        for i, r in enumerate(ranks):
            comp[i][0] = self._attn(r, pairs[i][i] * head_share, (ready[r],), prio + (0, sub), f"{tag} step 0")
        for t in range(1, g):
            for i, r in enumerate(ranks):
                prev, origin = (i - 1) % g, (i - t) % g
                buffer = (comp[i][t - 2],) if t >= 2 else ()
                have = (ready[ranks[prev]],) if t == 1 else (kv_hop[prev][t - 1],)
                kv_hop[i][t] = self._hop(group, t, ranks[prev], r, block_rows[origin], kvb, have + buffer,
                                         f"{tag} K/V step {t}")
                if self.backward:
                    dkv_hop[i][t] = self._hop(group, t, ranks[prev], r, block_rows[origin], kvb,
                                              grad_ready(prev, t - 1), f"{tag} dK/dV step {t}")
                comp[i][t] = self._attn(r, pairs[i][origin] * head_share, (kv_hop[i][t], comp[i][t - 1]),
                                        prio + (t, sub), f"{tag} step {t}")
        finals = {r: [comp[i][g - 1]] for i, r in enumerate(ranks)}
        if self.backward:  # the last step's dK/dV belongs to the next member: one hop home
            for i, r in enumerate(ranks):
                owner = (i + 1) % g
                finals[ranks[owner]].append(
                    self._hop(group, g, r, ranks[owner], block_rows[owner], kvb, grad_ready(i, g - 1),
                              f"{tag} dK/dV home"))
        return finals

    def _node_a2a(self, ranks: list[int], rows: list[int], per_row: float, deps: Deps, gather: bool, name: str) -> int:
        """All-to-all inside one node: a member's rows split evenly over the heads of the others
        (``gather=False``: members send their own rows' heads out; ``True``: return outputs)."""
        a = len(ranks)
        flows = [(ranks[s], ranks[d], (rows[d] if gather else rows[s]) * per_row / a)
                 for s in range(a) for d in range(a) if s != d]
        return self.net.all_to_all(flows, deps, name)

    def _hierarchical(self, group: CPGroup, ready: dict[int, int]) -> dict[int, list[int]]:
        a, n = group.a2a_size, group.ring_size
        c = self.costs
        rows = [self.plan.group_tokens(group.index, r) for r in group.ranks]
        node_ranks = [list(group.ranks[j * a:(j + 1) * a]) for j in range(n)]
        node_rows = [rows[j * a:(j + 1) * a] for j in range(n)]
        kv_share = max(1.0 / a, 1.0 / c.kv_heads)  # K/V heads replicate when fewer than ranks
        qkv = c.q_bytes + c.kv_bytes * kv_share * a  # per row before the a2a splits it over a heads
        in_bytes = c.q_bytes if self.backward else qkv
        out_bytes = qkv if self.backward else c.q_bytes
        first = [self._node_a2a(node_ranks[j], node_rows[j], in_bytes, [ready[r] for r in node_ranks[j]], False,
                                f"hierarchical g{group.index} a2a in")
                 for j in range(n)]
        lengths = [self.plan.lengths[i] for i in group.seqs]
        ends: list[list[int]] = [[] for _ in range(n)]
        for local in range(a):
            ring = [node_ranks[j][local] for j in range(n)]
            ring_ready = {node_ranks[j][local]: first[j] for j in range(n)}
            finals = self._ring(group, ring, lengths, ring_ready, [float(sum(r)) for r in node_rows],
                                1.0 / a, kv_share, local)
            for j in range(n):
                ends[j].extend(finals[ring[j]])
        out = {}
        for j in range(n):
            done = self._node_a2a(node_ranks[j], node_rows[j], out_bytes, ends[j], True,
                                  f"hierarchical g{group.index} a2a out")
            out.update({r: [done] for r in node_ranks[j]})
        return out

    def _ulysses(self, group: CPGroup, ready: dict[int, int]) -> dict[int, list[int]]:
        c, ranks = self.costs, group.ranks
        p = len(ranks)
        rows = [self.plan.group_tokens(group.index, r) for r in ranks]
        kv_share = max(1.0 / p, 1.0 / c.kv_heads)  # K/V heads replicate when fewer than ranks
        in_bytes: Callable[[int, int], float] = (lambda s, d: rows[s] * c.q_bytes / p) if self.backward else \
            (lambda s, d: rows[s] * (c.q_bytes / p + c.kv_bytes * kv_share))
        out_bytes: Callable[[int, int], float] = (
            lambda s, d: rows[d] * (c.q_bytes / p + c.kv_bytes * kv_share)) if self.backward else \
            (lambda s, d: rows[d] * c.q_bytes / p)
        flows = [(ranks[s], ranks[d], in_bytes(s, d)) for s in range(p) for d in range(p) if s != d]
        first = self.net.all_to_all(flows, [ready[r] for r in ranks], f"ulysses g{group.index} a2a in")
        pairs = sum(causal(self.plan.lengths[i]) for i in group.seqs) / p
        comp = [self._attn(r, pairs, (first,), (group.priority, group.index, 0), f"ulysses g{group.index}")
                for r in ranks]
        flows = [(ranks[s], ranks[d], out_bytes(s, d)) for s in range(p) for d in range(p) if s != d]
        done = self.net.all_to_all(flows, comp, f"ulysses g{group.index} a2a out")
        return {r: [done] for r in ranks}

    def _allgather(self, group: CPGroup, ready: dict[int, int]) -> dict[int, list[int]]:
        ranks, g = group.ranks, len(group.ranks)
        blocks = [self.plan.group_tokens(group.index, r) * self.costs.kv_bytes for r in ranks]
        gathered = self.net.all_gather(ranks, blocks, [ready[r] for r in ranks], f"allgather g{group.index} K/V")
        comp = []
        for i, r in enumerate(ranks):
            pairs = sum(member_prefix_pairs(self.plan.lengths[s], g, i) for s in group.seqs)
            comp.append(self._attn(r, pairs, (gathered,), (group.priority, group.index, 0),
                                   f"allgather g{group.index}"))
        if not self.backward:
            return {r: [comp[i]] for i, r in enumerate(ranks)}
        scattered = self.net.all_gather(ranks, blocks, comp,  # reduce-scatter of dK/dV: same traffic
                                        f"allgather g{group.index} dK/dV reduce-scatter")
        return {r: [scattered] for r in ranks}
