"""The context-parallel plan of one pack: frozen values that the simulator and the runtime read.

A pack is ``L`` tokens made of whole sequences; sequence ``i`` occupies pack positions
``[offsets[i], offsets[i] + lengths[i])`` and attends causally to itself only.

* ``Segment``: a run of one sequence's tokens held by a rank in the *attention layout*:
  ``(seq, start, end)`` are offsets inside the sequence, which are also the tokens' position ids
  (RoPE restarts at every sequence); ``pack_start`` places it in the pack.
* ``CPGroup``: ranks that run attention together for some sequences (one ring per group; all its
  sequences share every ring step's message):

  ========== ====================================================================================
  kind        what the members do
  ========== ====================================================================================
  local       one rank, no communication
  zigzag      ring over ``ranks`` in that order; each sequence cut into ``2g`` chunks (``g`` =
              ring size), member ``i`` holds chunks ``i`` and ``2g-1-i``; K/V blocks travel to
              the next member every step; ``routed`` groups send inter-node hops through the
              routing layer
  hierarchical ``ranks`` are node-major (``ring_size`` nodes x ``a2a_size`` ranks). Each sequence
              is cut into ``2n`` node chunks (node ``j`` holds ``j`` and ``2n-1-j``), each chunk
              into ``a2a_size`` parts (local rank ``l`` holds part ``l``). An all-to-all inside the
              node turns tokens into heads, then ``a2a_size`` rings (one per local index) run
              across the nodes, then an all-to-all gives outputs back
  ulysses     one all-to-all over ``ranks`` (tokens -> heads), local attention, all-to-all back
  allgather   queries zigzag as in ``zigzag``; the K/V of every member are all-gathered first
  ========== ====================================================================================

* ``RankLayout``: a rank's segments in its local token order: groups by priority (inter-node,
  intra-node, local; then group index), inside a group by the group's sequence order, then by
  chunk index, then part.
* ``CPPlan``: everything above plus a ``digest()`` ranks compare before running it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal

GroupKind = Literal["local", "zigzag", "hierarchical", "ulysses", "allgather"]
Scope = Literal["local", "intra", "inter"]
SCOPE_PRIORITY = {"inter": 0, "intra": 1, "local": 2}


@dataclass(frozen=True)
class Segment:
    seq: int
    start: int
    end: int
    pack_start: int
    group: int  # index into CPPlan.groups
    chunk: int = 0  # zigzag chunk of the sequence inside its group (node chunk for hierarchical)
    part: int = 0  # hierarchical: which of the node's a2a_size parts of the chunk

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def positions(self) -> range:
        return range(self.start, self.end)

    def text(self) -> str:
        return f"{self.seq}:{self.start}-{self.end}@{self.pack_start}/g{self.group}c{self.chunk}p{self.part}"


@dataclass(frozen=True)
class CPGroup:
    index: int
    kind: GroupKind
    scope: Scope
    ranks: tuple[int, ...]  # ring order (zigzag, allgather), node-major (hierarchical)
    seqs: tuple[int, ...]
    ring_size: int = 1  # members along one ring (hierarchical: nodes)
    a2a_size: int = 1  # members of one all-to-all (hierarchical: ranks per node; ulysses: all)
    routed: bool = False

    @property
    def priority(self) -> int:
        return SCOPE_PRIORITY[self.scope]

    def ring_neighbours(self, rank: int) -> tuple[int, int]:
        """(previous, next) member of ``rank`` on its ring."""
        i = self.ranks.index(rank)
        if self.kind == "hierarchical":
            a, n = self.a2a_size, self.ring_size
            node, local = divmod(i, a)
            return self.ranks[((node - 1) % n) * a + local], self.ranks[((node + 1) % n) * a + local]
        g = len(self.ranks)
        return self.ranks[(i - 1) % g], self.ranks[(i + 1) % g]

    def text(self) -> str:
        return (
            f"G{self.index} {self.kind} {self.scope} ranks={','.join(map(str, self.ranks))} "
            f"ring={self.ring_size} a2a={self.a2a_size} routed={int(self.routed)} "
            f"seqs={','.join(map(str, self.seqs))}"
        )


@dataclass(frozen=True)
class RankLayout:
    rank: int
    segments: tuple[Segment, ...]

    @property
    def num_tokens(self) -> int:
        return sum(s.length for s in self.segments)

    def groups(self) -> tuple[int, ...]:
        seen: dict[int, None] = {}
        for s in self.segments:
            seen.setdefault(s.group)
        return tuple(seen)

    def position_ids(self) -> list[int]:
        return [p for s in self.segments for p in s.positions]


@dataclass(frozen=True)
class CPPlan:
    engine: str
    lengths: tuple[int, ...]
    num_ranks: int
    ranks_per_node: int
    groups: tuple[CPGroup, ...]
    ranks: tuple[RankLayout, ...]
    picked: str = ""  # Zeppelin: whose placement it kept for this pack ("zeppelin", "ulysses", ...)

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        out, acc = [], 0
        for s in self.lengths:
            out.append(acc)
            acc += s
        return tuple(out)

    @property
    def pack_length(self) -> int:
        return sum(self.lengths)

    def tokens_per_rank(self) -> tuple[int, ...]:
        return tuple(r.num_tokens for r in self.ranks)

    def group_tokens(self, group: int, rank: int) -> int:
        """Tokens ``rank`` holds in ``group`` (the size of its K/V block on that group's ring)."""
        return sum(s.length for s in self.ranks[rank].segments if s.group == group)

    def groups_of(self, rank: int) -> tuple[CPGroup, ...]:
        """Groups ``rank`` is a member of (also those where it holds no token: a sequence shorter
        than ``2g`` leaves some zigzag chunks empty, but every member still runs the ring)."""
        return tuple(g for g in self.groups if rank in g.ranks)

    def canonical_text(self) -> str:
        picked = f" picked={self.picked}" if self.picked else ""
        lines = [
            f"engine={self.engine}{picked} ranks={self.num_ranks} per_node={self.ranks_per_node}",
            "lengths=" + ",".join(map(str, self.lengths)),
        ]
        lines += [g.text() for g in self.groups]
        lines += [f"R{r.rank} " + " ".join(s.text() for s in r.segments) for r in self.ranks]
        return "\n".join(lines) + "\n"

    def digest(self) -> str:
        """sha256 of ``canonical_text()``: ranks compare it to agree on the plan."""
        return hashlib.sha256(self.canonical_text().encode()).hexdigest()

    def summary(self) -> dict[str, Any]:
        by_kind: dict[str, int] = {}
        for g in self.groups:
            key = g.kind if g.kind != "zigzag" else f"zigzag-{g.scope}"
            by_kind[key] = by_kind.get(key, 0) + len(g.seqs)
        tokens = self.tokens_per_rank()
        return {
            "engine": self.engine,
            "picked": self.picked or self.engine,
            "sequences": len(self.lengths),
            "groups": len(self.groups),
            "sequences_by_kind": by_kind,
            "max_tokens_per_rank": max(tokens),
            "min_tokens_per_rank": min(tokens),
            "digest": self.digest()[:16],
        }
