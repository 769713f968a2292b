"""Prices one attention pass (forward or backward) of a ``CPPlan`` by walking its step program.

The steps are ``plan.cp.program``'s, the ones the runtime executes. Per group, the simulator walks
every participant's step list round by round (``ROUND`` ends a round), as the runtime's queue
interpreter does, and turns each step into tasks of the event graph. A collective is priced when
its last participant (in group order) posts it, so every participant's earlier steps exist.

* ring groups (``zigzag``, and the per-local-index rings of ``hierarchical``): ``ring``.
* ``hierarchical``: ``POST_QKV`` (``DO``) of the node's last member is the node's all-to-all in,
  then ``a2a_size`` rings over the nodes (one per local index, each on its members' own NIC
  shares, computing ``1 / a2a_size`` of the heads), ``POST_OUT`` (``DQKV``) the all-to-all back.
* ``ulysses``: one all-to-all over all members, full-sequence attention on ``1 / C`` of the heads
  at ``C0``, one all-to-all back.
* ``allgather``: the last member's ``POST_GATHER`` is the all-gather of K/V; ``C0`` prices the
  member's zigzag queries against their whole prefix as one kernel (the cost model has no
  per-block split), the other ``C`` steps are inside it; backward: ``POST_SCATTER`` is the
  reduce-scatter of dK/dV.
* ``local``: ``C0`` is one task per sequence.

``walked[(rank, group)]`` lists the step strings in the order priced, to check against the runtime.
Every task a step creates is named ``GroupTask.step_name`` of that step (``cp fwd G3 zigzag/inter
C2``), the runtime's profiler label for it; a task's ``detail`` says which part of the step it is.
"""

from __future__ import annotations

from typing import Callable

from megatron_slim.plan.cp.costs import CPCosts
from megatron_slim.plan.cp.layout import CPGroup, CPPlan
from megatron_slim.plan.cp.program import CPProgram, GroupTask, Step
from megatron_slim.plan.cp.routing import RoutingPlan
from megatron_slim.plan.cp.zigzag import causal, member_prefix_pairs
from megatron_slim.plan.sim.cp.events import Deps, Priority
from megatron_slim.plan.sim.cp.network import Network
from megatron_slim.plan.sim.cp.ring import RingPricer

__all__ = ["AttentionBuilder", "rounds"]
Pricer = Callable[[int, Step, str], None]  # prices one step of one rank; the str names its tasks
Finals = Callable[[], dict[int, list[int]]]  # per member, the tasks its post-attention work waits for


def rounds(steps: tuple[Step, ...]) -> list[list[Step]]:
    """The steps cut after each ``ROUND``."""
    out: list[list[Step]] = [[]]
    for s in steps:
        out[-1].append(s)
        if s.op == "ROUND":
            out.append([])
    return out if out[-1] else out[:-1]


class AttentionBuilder:
    def __init__(
        self,
        plan: CPPlan,
        costs: CPCosts,
        net: Network,
        routing: RoutingPlan | None,
        backward: bool,
        program: CPProgram,
    ) -> None:
        self.plan, self.costs, self.net, self.routing, self.backward = plan, costs, net, routing, backward
        self.program = program
        self.graph = net.graph
        self.walked: dict[tuple[int, int], list[str]] = {}

    def attn(self, rank: int, pairs: float, deps: Deps, priority: Priority, name: str, detail: str = "") -> int:
        seconds = self.costs.attention_s(pairs, self.backward)
        return self.graph.compute(rank, seconds, deps, priority, name=name, detail=detail)

    def hop(
        self,
        group: CPGroup,
        step: int,
        src: int,
        dst: int,
        rows: float,
        per_row: float,
        deps: Deps,
        name: str,
        detail: str = "",
    ) -> int:
        route = self.routing.route_for(group.index, step, dst) if (self.routing and group.routed) else None
        if route is not None and route.routed:
            return self.net.routed(route, per_row, deps, name, detail)
        return self.net.transfer(src, dst, rows * per_row, deps, name, detail)

    def build(self, group: CPGroup, ready: dict[int, int]) -> dict[int, list[int]]:
        """Tasks of ``group``; ``ready[rank]`` is the task after which a member may start.
        Returns, per member, the tasks its post-attention work must wait for."""
        pricers: Callable[[CPGroup, dict[int, int]], tuple[Pricer, Finals]] = getattr(self, f"_{group.kind}")
        price, finals = pricers(group, ready)
        relays = sorted(
            r
            for r in range(self.plan.num_ranks)
            if r not in group.ranks and self.program.task(r, group.index) is not None
        )
        walkers = [(r, self._task(r, group)) for r in (*group.ranks, *relays)]
        cut = [rounds(task.steps(self.backward)) for _, task in walkers]
        for k in range(max(len(c) for c in cut)):
            for (rank, task), steps in zip(walkers, cut):
                for step in steps[k] if k < len(steps) else ():
                    price(rank, step, task.step_name(step, self.backward))
                    self.walked.setdefault((rank, group.index), []).append(str(step))
        return finals()

    def _task(self, rank: int, group: CPGroup) -> GroupTask:
        task = self.program.task(rank, group.index)
        assert task is not None, f"rank {rank} has no task in group {group.index}"
        return task

    # ---- kinds ------------------------------------------------------------------------------------
    def _local(self, group: CPGroup, ready: dict[int, int]) -> tuple[Pricer, Finals]:
        rank = group.ranks[0]
        out: dict[int, list[int]] = {}

        def price(r: int, step: Step, name: str) -> None:
            if step.op == "C":
                out[r] = [
                    self.attn(
                        r,
                        causal(self.plan.lengths[i]),
                        (ready[r],),
                        (group.priority, group.index, k),
                        name,
                        f"seq {i} ({self.plan.lengths[i]} tokens)",
                    )
                    for k, i in enumerate(group.seqs)
                ]

        return price, lambda: {rank: out.get(rank, [])}

    def _zigzag(self, group: CPGroup, ready: dict[int, int]) -> tuple[Pricer, Finals]:
        ring = RingPricer(
            self,
            group,
            list(group.ranks),
            [self.plan.lengths[i] for i in group.seqs],
            ready,
            [self.plan.group_tokens(group.index, r) for r in group.ranks],
            1.0,
            1.0,
            0,
        )
        return ring.price, ring.finals

    def _node_a2a(
        self, ranks: list[int], rows: list[int], per_row: float, deps: Deps, gather: bool, name: str, detail: str
    ) -> int:
        """All-to-all inside one node: a member's rows split evenly over the heads of the others
        (``gather=False``: members send their own rows' heads out; ``True``: return outputs)."""
        a = len(ranks)
        flows = [
            (ranks[s], ranks[d], (rows[d] if gather else rows[s]) * per_row / a)
            for s in range(a)
            for d in range(a)
            if s != d
        ]
        return self.net.all_to_all(flows, deps, name, detail)

    def _hierarchical(self, group: CPGroup, ready: dict[int, int]) -> tuple[Pricer, Finals]:
        a, n = group.a2a_size, group.ring_size
        c = self.costs
        rows = [self.plan.group_tokens(group.index, r) for r in group.ranks]
        node_ranks = [list(group.ranks[j * a : (j + 1) * a]) for j in range(n)]
        node_rows = [rows[j * a : (j + 1) * a] for j in range(n)]
        kv_share = max(1.0 / a, 1.0 / c.kv_heads)  # K/V heads replicate when fewer than ranks
        qkv = c.q_bytes + c.kv_bytes * kv_share * a  # per row before the a2a splits it over a heads
        in_bytes = c.q_bytes if self.backward else qkv
        out_bytes = qkv if self.backward else c.q_bytes
        lengths = [self.plan.lengths[i] for i in group.seqs]
        first: dict[int, int] = {}
        rings: list[RingPricer] = []
        out: dict[int, list[int]] = {}

        def price(rank: int, step: Step, name: str) -> None:
            j, local = divmod(group.ranks.index(rank), a)
            if step.what in ("QKV", "DO", "OUT", "DQKV") and local < a - 1:
                return
            if step.op == "POST" and step.what in ("QKV", "DO"):
                first[j] = self._node_a2a(
                    node_ranks[j],
                    node_rows[j],
                    in_bytes,
                    [ready[r] for r in node_ranks[j]],
                    False,
                    name,
                    f"node {j}",
                )
            elif step.op == "POST" and step.what in ("OUT", "DQKV"):
                ends = [t for sub, ring in enumerate(rings) for t in ring.final(node_ranks[j][sub])]
                done = self._node_a2a(node_ranks[j], node_rows[j], out_bytes, ends, True, name, f"node {j}")
                out.update({r: [done] for r in node_ranks[j]})
            elif step.op == "C" or step.what in ("KV", "DKV"):
                if not rings:
                    rings.extend(
                        RingPricer(
                            self,
                            group,
                            [node_ranks[m][sub] for m in range(n)],
                            lengths,
                            {node_ranks[m][sub]: first[m] for m in range(n)},
                            [float(sum(r)) for r in node_rows],
                            1.0 / a,
                            kv_share,
                            sub,
                        )
                        for sub in range(a)
                    )
                rings[local].price(rank, step, name)

        return price, lambda: out

    def _ulysses(self, group: CPGroup, ready: dict[int, int]) -> tuple[Pricer, Finals]:
        c, ranks = self.costs, group.ranks
        p = len(ranks)
        rows = [self.plan.group_tokens(group.index, r) for r in ranks]
        kv_share = max(1.0 / p, 1.0 / c.kv_heads)  # K/V heads replicate when fewer than ranks
        in_bytes: Callable[[int, int], float] = (
            (lambda s, d: rows[s] * c.q_bytes / p)
            if self.backward
            else (lambda s, d: rows[s] * (c.q_bytes / p + c.kv_bytes * kv_share))
        )
        out_bytes: Callable[[int, int], float] = (
            (lambda s, d: rows[d] * (c.q_bytes / p + c.kv_bytes * kv_share))
            if self.backward
            else (lambda s, d: rows[d] * c.q_bytes / p)
        )
        pairs = sum(causal(self.plan.lengths[i]) for i in group.seqs) / p
        tids: dict[str, int] = {}
        comp: list[int] = []

        def price(rank: int, step: Step, name: str) -> None:
            if step.op == "POST" and step.what in ("QKV", "DO") and rank == ranks[-1]:
                flows = [(ranks[s], ranks[d], in_bytes(s, d)) for s in range(p) for d in range(p) if s != d]
                tids["in"] = self.net.all_to_all(flows, [ready[r] for r in ranks], name)
            elif step.op == "C":
                comp.append(self.attn(rank, pairs, (tids["in"],), (group.priority, group.index, 0), name))
            elif step.op == "POST" and step.what in ("OUT", "DQKV") and rank == ranks[-1]:
                flows = [(ranks[s], ranks[d], out_bytes(s, d)) for s in range(p) for d in range(p) if s != d]
                tids["out"] = self.net.all_to_all(flows, comp, name)

        return price, lambda: {r: [tids["out"]] for r in ranks}

    def _allgather(self, group: CPGroup, ready: dict[int, int]) -> tuple[Pricer, Finals]:
        ranks, g = group.ranks, len(group.ranks)
        blocks = [self.plan.group_tokens(group.index, r) * self.costs.kv_bytes for r in ranks]
        tids: dict[str, int] = {}
        comp: dict[int, int] = {}

        def price(rank: int, step: Step, name: str) -> None:
            i = ranks.index(rank)
            if step.op == "POST" and step.what == "GATHER" and i == g - 1:
                tids["gather"] = self.net.all_gather(ranks, blocks, [ready[r] for r in ranks], name)
            elif step.op == "C" and step.step == 0:
                pairs = sum(member_prefix_pairs(self.plan.lengths[s], g, i) for s in group.seqs)
                comp[rank] = self.attn(
                    rank, pairs, (tids["gather"],), (group.priority, group.index, 0), name, "with every other block"
                )
            elif step.op == "POST" and step.what == "SCATTER" and i == g - 1:  # same traffic as the gather
                tids["scatter"] = self.net.all_gather(ranks, blocks, [comp[r] for r in ranks], name)

        return price, lambda: {r: [tids["scatter"] if self.backward else comp[r]] for r in ranks}
