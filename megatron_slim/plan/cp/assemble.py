"""Turn "these sequences run as this kind of group on these ranks" into a ``CPPlan``.

Every planner (Zeppelin and the baselines) decides only ``GroupSpec``s; the token segments, their
order and the group numbering come from here, so all engines share one definition of the layout.
Groups are numbered by scope priority (inter-node, intra-node, local), keeping the planner's order
inside a priority.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_slim.plan.cp.layout import SCOPE_PRIORITY, CPGroup, CPPlan, GroupKind, RankLayout, Scope, Segment
from megatron_slim.plan.cp.topology import CPTopology
from megatron_slim.plan.cp.zigzag import contiguous_ranges, hierarchical_ranges, member_ranges


@dataclass(frozen=True)
class GroupSpec:
    kind: GroupKind
    ranks: tuple[int, ...]
    seqs: tuple[int, ...]
    a2a_size: int = 1  # hierarchical: ranks per node; ignored otherwise
    routed: bool = False


def scope_of(ranks: tuple[int, ...], topo: CPTopology) -> Scope:
    if len(ranks) == 1:
        return "local"
    return "intra" if len({topo.node_of(r) for r in ranks}) == 1 else "inter"


def _ring_size(spec: GroupSpec) -> int:
    if spec.kind == "hierarchical":
        return len(spec.ranks) // spec.a2a_size
    if spec.kind in ("zigzag", "allgather"):
        return len(spec.ranks)
    return 1


def _a2a_size(spec: GroupSpec) -> int:
    if spec.kind == "hierarchical":
        return spec.a2a_size
    return len(spec.ranks) if spec.kind == "ulysses" else 1


def _segments(
    spec: GroupSpec, index: int, member: int, lengths: tuple[int, ...], offsets: tuple[int, ...]
) -> list[Segment]:
    out: list[Segment] = []
    if spec.kind == "local":
        return [Segment(i, 0, lengths[i], offsets[i], index) for i in spec.seqs if lengths[i]]
    if spec.kind == "ulysses":
        sub = [lengths[i] for i in spec.seqs]
        for j, a, b in contiguous_ranges(sub, len(spec.ranks), member):
            i = spec.seqs[j]
            out.append(Segment(i, a, b, offsets[i] + a, index))
        return out
    if spec.kind == "hierarchical":
        nodes = len(spec.ranks) // spec.a2a_size
        node, local = divmod(member, spec.a2a_size)
        for i in spec.seqs:
            for chunk, part, a, b in hierarchical_ranges(lengths[i], nodes, spec.a2a_size, node, local):
                out.append(Segment(i, a, b, offsets[i] + a, index, chunk, part))
        return out
    for i in spec.seqs:  # zigzag, allgather
        for chunk, a, b in member_ranges(lengths[i], len(spec.ranks), member):
            out.append(Segment(i, a, b, offsets[i] + a, index, chunk))
    return out


def assemble(
    engine: str, lengths: tuple[int, ...], topo: CPTopology, specs: list[GroupSpec], picked: str = ""
) -> CPPlan:
    lengths = tuple(int(s) for s in lengths)
    offsets, acc = [], 0
    for s in lengths:
        offsets.append(acc)
        acc += s
    scoped = [(SCOPE_PRIORITY[scope_of(s.ranks, topo)], n, s) for n, s in enumerate(specs)]
    scoped.sort(key=lambda t: (t[0], t[1]))
    groups: list[CPGroup] = []
    per_rank: list[list[Segment]] = [[] for _ in range(topo.num_ranks)]
    for index, (_, _, spec) in enumerate(scoped):
        scope = scope_of(spec.ranks, topo)
        groups.append(
            CPGroup(
                index,
                spec.kind,
                scope,
                tuple(spec.ranks),
                tuple(spec.seqs),
                _ring_size(spec),
                _a2a_size(spec),
                spec.routed and scope == "inter",
            )
        )
        for member, rank in enumerate(spec.ranks):
            per_rank[rank].extend(_segments(spec, index, member, lengths, tuple(offsets)))
    layouts = tuple(RankLayout(r, tuple(segs)) for r, segs in enumerate(per_rank))
    return CPPlan(engine, lengths, topo.num_ranks, topo.ranks_per_node, tuple(groups), layouts, picked)
