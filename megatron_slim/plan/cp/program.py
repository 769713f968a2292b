"""A ``CPPlan`` (+ ``RoutingPlan``) lowered to one step program per rank; pure Python, no torch.

The one description of the context-parallel protocol: the runtime (``runtime.cp``) executes these
steps and the simulator (``plan.sim.cp.attention``) prices them, so the two cannot drift apart.

A rank's program is its group tasks in queue order (the plan's scope priority: inter-node groups,
then intra-node, then local). A rank gets a task for every group it belongs to and, for routed
zigzag rings, for every ring whose hops it relays without being a member (proxies of another
node's hops); a relay task runs the ring's exchanges only. Each task has a forward and a backward
step list; ``ROUND`` marks where the runtime yields to the next group task (``run_queues``), so a
group's first transfer is in flight before any group computes.

Step strings (inside one group task): ``POST_KV2`` posts the K/V exchange of ring step 2 (send the
block on, receive the next one), ``WAIT_KV2`` waits for it, ``C2`` computes against the block of
ring member ``i - 2`` (``C0``: its own block, the causal one); ``QKV``/``OUT`` are the head
all-to-alls of the forward, ``DO``/``DQKV`` those of the backward, ``GATHER``/``SCATTER`` the K/V
all-gather and the dK/dV reduce-scatter, ``DKV`` the ring's dK/dV hand-on (step ``g``: home).
A task's text is ``G3:zigzag/inter(member)``.

``GroupTask.step_name`` names a step as both the simulator's Chrome trace (``plan.sim.cp``) and the
runtime's profiler labels (``record_function``) show it: ``cp fwd G3 zigzag/inter POST_KV2``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional

from megatron_slim.plan.cp.layout import CPGroup, CPPlan
from megatron_slim.plan.cp.routing import RoutingPlan

KINDS = ("local", "zigzag", "hierarchical", "ulysses", "allgather")
OPS = ("POST", "WAIT", "C", "ROUND")
MESSAGES = ("KV", "DKV", "QKV", "OUT", "DO", "DQKV", "GATHER", "SCATTER")


@dataclass(frozen=True)
class Step:
    op: str  # POST | WAIT | C | ROUND
    what: str = ""  # the exchange posted or waited for (MESSAGES); "" for C and ROUND
    step: int = 0  # ring step (C: the block of member i - step)

    def __str__(self) -> str:
        if self.op == "ROUND":
            return "ROUND"
        if self.op == "C":
            return f"C{self.step}"
        return f"{self.op}_{self.what}{self.step if self.what in ('KV', 'DKV') else ''}"


ROUND = Step("ROUND")


def _exchange(what: str, step: int = 0) -> tuple[Step, Step, Step]:
    """Post, yield to the other groups, wait."""
    return Step("POST", what, step), ROUND, Step("WAIT", what, step)


@dataclass(frozen=True)
class GroupTask:
    group: int
    kind: str
    scope: str
    member: bool  # False: relays this ring's routed hops, computes nothing
    forward: tuple[Step, ...]
    backward: tuple[Step, ...]

    def steps(self, backward: bool) -> tuple[Step, ...]:
        return self.backward if backward else self.forward

    def __str__(self) -> str:
        return f"G{self.group}:{self.kind}/{self.scope}({'member' if self.member else 'relay'})"

    def step_name(self, step: Step, backward: bool) -> str:
        """``cp fwd G3 zigzag/inter C2``: the one name of ``step`` in simulated traces and runtime
        profiles, the same on every member and relay of the group."""
        return f"cp {'bwd' if backward else 'fwd'} G{self.group} {self.kind}/{self.scope} {step}"


@dataclass(frozen=True)
class RankSteps:
    rank: int
    tokens: int
    tasks: tuple[GroupTask, ...]

    def describe(self) -> str:
        return f"rank {self.rank}, {self.tokens} tokens: " + " -> ".join(str(t) for t in self.tasks)


@dataclass(frozen=True)
class CPProgram:
    """``ranks[r]``: the group tasks rank ``r`` runs, in queue order."""

    ranks: tuple[RankSteps, ...]

    def task(self, rank: int, group: int) -> Optional[GroupTask]:
        return next((t for t in self.ranks[rank].tasks if t.group == group), None)

    def to_text(self) -> str:
        lines = []
        for rs in self.ranks:
            lines.append(f"rank {rs.rank} tokens={rs.tokens}")
            for t in rs.tasks:
                for name, steps in (("fwd", t.forward), ("bwd", t.backward)):
                    lines.append(f"  {t} {name}: " + ",".join(str(s) for s in steps))
        return "\n".join(lines) + "\n"

    def digest(self) -> str:
        return hashlib.sha256(self.to_text().encode()).hexdigest()[:16]


# ---- step lists ----------------------------------------------------------------------------------
def ring_forward(g: int, member: bool) -> list[Step]:
    steps = [Step("POST", "KV", 1)] if g > 1 else []
    steps += [ROUND] + ([Step("C", "", 0)] if member else [])
    for s in range(1, g):
        steps += [ROUND, Step("WAIT", "KV", s)] + ([Step("POST", "KV", s + 1)] if s + 1 < g else [])
        steps += [Step("C", "", s)] if member else []
    return steps


def ring_backward(g: int, member: bool) -> list[Step]:
    steps = [Step("POST", "KV", 1)] if g > 1 else []
    steps += [ROUND] + ([Step("C", "", 0)] if member else [])
    if g == 1:
        return steps
    for s in range(1, g):
        steps += [ROUND, Step("WAIT", "KV", s)] + ([Step("POST", "KV", s + 1)] if s + 1 < g else [])
        steps += [Step("POST", "DKV", s), Step("WAIT", "DKV", s)] + ([Step("C", "", s)] if member else [])
    return steps + [ROUND, Step("POST", "DKV", g), Step("WAIT", "DKV", g)]


def split_group_steps(g: int, a: int, member: bool) -> tuple[list[Step], list[Step]]:
    """Forward and backward of "all-to-all in the node (``a > 1``), ring of ``g`` across"."""
    fwd, bwd = ring_forward(g, member), ring_backward(g, member)
    if a > 1:
        fwd = [*_exchange("QKV"), *fwd, *_exchange("OUT")]
        bwd = [*_exchange("DO"), *bwd, *_exchange("DQKV")]
    return fwd, bwd


def allgather_steps(g: int, i: int) -> tuple[list[Step], list[Step]]:
    """Member ``i``: its own block while the gather flies, then the others in member order."""
    others = [Step("C", "", (i - j) % g) for j in range(g) if j != i]
    post, _, wait = _exchange("GATHER")
    fwd = [post, ROUND, Step("C", "", 0), ROUND, wait, *others]
    return fwd, [*fwd, *_exchange("SCATTER")]


def ring_geometry(group: CPGroup) -> tuple[int, int]:
    """``(g, a)``: ring length and all-to-all width of a split group."""
    a = group.a2a_size if group.kind in ("ulysses", "hierarchical") else 1
    if len(group.ranks) % a:
        raise ValueError(f"group {group.index}: {len(group.ranks)} ranks are not whole nodes of {a}")
    return len(group.ranks) // a, a


# ---- lowering ------------------------------------------------------------------------------------
def relays(plan: CPPlan, group: CPGroup, routing: Optional[RoutingPlan]) -> set[int]:
    """Non-members that carry a part of one of ``group``'s routed hops (a proxy of the route)."""
    if routing is None or group.kind != "zigzag":
        return set()
    members, g = group.ranks, len(group.ranks)
    rows = [plan.group_tokens(group.index, r) for r in members]
    out: set[int] = set()
    for step in range(1, g + 1):  # K/V steps 1 .. g-1, dK/dV steps 1 .. g (home)
        for j in range(g):
            src, dst = members[j - 1], members[j]
            route = routing.route_for(group.index, step, dst)
            if src == dst or rows[(j - step) % g] == 0 or route is None or not route.routed:
                continue
            out.update(r for p in route.parts for r in (p.proxy_src, p.proxy_dst))
    return out - set(members)


def group_task(plan: CPPlan, group: CPGroup, rank: int) -> GroupTask:
    member = rank in group.ranks
    if group.kind == "allgather":
        fwd, bwd = allgather_steps(len(group.ranks), group.ranks.index(rank))
    else:
        fwd, bwd = split_group_steps(*ring_geometry(group), member)
    return GroupTask(group.index, group.kind, group.scope, member, tuple(fwd), tuple(bwd))


def lower_rank(plan: CPPlan, rank: int, routing: Optional[RoutingPlan] = None) -> RankSteps:
    if not 0 <= rank < plan.num_ranks:
        raise ValueError(f"rank {rank}: the plan has ranks 0..{plan.num_ranks - 1}")
    tasks = []
    for group in sorted(plan.groups, key=lambda g: (g.priority, g.index)):
        if group.kind not in KINDS:
            raise ValueError(f"group {group.index}: kind {group.kind!r} is unknown; allowed: {', '.join(KINDS)}")
        if rank in group.ranks or rank in relays(plan, group, routing):
            tasks.append(group_task(plan, group, rank))
    covered = sum(plan.group_tokens(t.group, rank) for t in tasks if t.member)
    if covered != plan.ranks[rank].num_tokens:
        raise ValueError(
            f"rank {rank}: its groups cover {covered} of its {plan.ranks[rank].num_tokens} tokens; "
            "the plan is inconsistent"
        )
    return RankSteps(rank, plan.ranks[rank].num_tokens, tuple(tasks))


def lower_cp(plan: CPPlan, routing: Optional[RoutingPlan] = None) -> CPProgram:
    """Every rank's step program (what each runtime rank executes and the simulator prices)."""
    return CPProgram(tuple(lower_rank(plan, r, routing) for r in range(plan.num_ranks)))
