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
from megatron_slim.plan.cp.zigzag import chunk_bounds, contiguous_ranges, zigzag_chunks


@dataclass(frozen=True)
class GroupSpec:
    kind: GroupKind
    ranks: tuple[int, ...]
    seqs: tuple[int, ...]
    a2a_size: int = 1  # hierarchical: ranks per node; ignored otherwise
    routed: bool = False


def _segment(seq: int, start: int, end: int, pack_start: int, group: int, chunk: int = 0, part: int = 0) -> Segment:
    """``Segment(...)``, equal to it, built without the frozen dataclass's ``object.__setattr__``
    per field: a plan of a 4M-token batch holds thousands of segments, and building them was
    most of ``assemble``'s time."""
    seg = object.__new__(Segment)
    seg.__dict__.update(
        {"seq": seq, "start": start, "end": end, "pack_start": pack_start, "group": group, "chunk": chunk, "part": part}
    )
    return seg


def scope_of(ranks: tuple[int, ...], topo: CPTopology) -> Scope:
    if len(ranks) == 1:
        return "local"
    return "intra" if topo.node_of(min(ranks)) == topo.node_of(max(ranks)) else "inter"  # nodes: rank ranges


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


def _ring_segments(spec: GroupSpec, index: int, lengths: tuple[int, ...], offsets: list[int]) -> list[list[Segment]]:
    """Every member's segments of a zigzag / allgather group (chunk bounds cut once per sequence)."""
    g = len(spec.ranks)
    out: list[list[Segment]] = [[] for _ in range(g)]
    for i in spec.seqs:
        b, off = chunk_bounds(lengths[i], 2 * g), offsets[i]
        for member, segs in enumerate(out):
            for c in zigzag_chunks(member, g):
                if b[c + 1] > b[c]:
                    segs.append(_segment(i, b[c], b[c + 1], off + b[c], index, c))
    return out


def _hierarchical_segments(
    spec: GroupSpec, index: int, lengths: tuple[int, ...], offsets: list[int]
) -> list[list[Segment]]:
    """Every member's segments of a hierarchical group: member ``node * a + local`` holds part
    ``local`` of its node's two zigzag chunks (``zigzag.hierarchical_ranges``)."""
    a = spec.a2a_size
    nodes = len(spec.ranks) // a
    out: list[list[Segment]] = [[] for _ in spec.ranks]
    for i in spec.seqs:
        b, off = chunk_bounds(lengths[i], 2 * nodes), offsets[i]
        subs = [chunk_bounds(b[c + 1] - b[c], a) for c in range(2 * nodes)]
        for member, segs in enumerate(out):
            node, local = divmod(member, a)
            for c in zigzag_chunks(node, nodes):
                start, end = b[c] + subs[c][local], b[c] + subs[c][local + 1]
                if end > start:
                    segs.append(_segment(i, start, end, off + start, index, c, local))
    return out


def _segments(spec: GroupSpec, index: int, lengths: tuple[int, ...], offsets: list[int]) -> list[list[Segment]]:
    """Every member's segments of one group, in the member's local order."""
    if spec.kind == "local":
        return [[_segment(i, 0, lengths[i], offsets[i], index) for i in spec.seqs if lengths[i]]]
    if spec.kind == "hierarchical":
        return _hierarchical_segments(spec, index, lengths, offsets)
    if spec.kind in ("zigzag", "allgather"):
        return _ring_segments(spec, index, lengths, offsets)
    sub = [lengths[i] for i in spec.seqs]  # ulysses
    out: list[list[Segment]] = []
    for member in range(len(spec.ranks)):
        ranges = contiguous_ranges(sub, len(spec.ranks), member)
        out.append([_segment(spec.seqs[j], a, b, offsets[spec.seqs[j]] + a, index) for j, a, b in ranges])
    return out


def assemble(
    engine: str, lengths: tuple[int, ...], topo: CPTopology, specs: list[GroupSpec], picked: str = ""
) -> CPPlan:
    lengths = tuple(int(s) for s in lengths)
    offsets, acc = [], 0
    for s in lengths:
        offsets.append(acc)
        acc += s
    scopes = [scope_of(s.ranks, topo) for s in specs]
    order = sorted(range(len(specs)), key=lambda n: SCOPE_PRIORITY[scopes[n]])  # stable: the planner's order
    groups: list[CPGroup] = []
    per_rank: list[list[Segment]] = [[] for _ in range(topo.num_ranks)]
    for index, n in enumerate(order):
        spec, scope = specs[n], scopes[n]
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
        for rank, segs in zip(spec.ranks, _segments(spec, index, lengths, offsets)):
            per_rank[rank].extend(segs)
    layouts = tuple(RankLayout(r, tuple(segs)) for r, segs in enumerate(per_rank))
    return CPPlan(engine, lengths, topo.num_ranks, topo.ranks_per_node, tuple(groups), layouts, picked)
