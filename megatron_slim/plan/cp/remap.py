"""Zeppelin's remapping layer: from the attention layout to a token-balanced layout and back.

The linear modules (MLP) cost the same per token wherever the token is, so before them each rank
should hold ``floor(L / C)`` or ``ceil(L / C)`` tokens. ``plan_remap`` moves as few tokens as
possible and prefers NVLink:

* the ``L mod C`` ranks holding the most tokens (ties: lower rank) get the ``ceil`` targets, which
  minimises the surplus to move;
* a rank keeps its first ``min(own, target)`` tokens at the same local offsets; only surplus
  (its tail) leaves, only ranks below target receive, so no rank both sends and receives and the
  tokens moved equal the total surplus -- the least any remap can move;
* surplus is matched to deficit inside each node first (ranks in order), then across nodes
  (nodes in order), so no token crosses a NIC while a deficit on its own node is unfilled.

Transfers are exact local ranges, ``(src, [a, b)) -> (dst, [c, d))``: source offsets index the
source layout of ``src`` (its ``RankLayout`` segments flattened), destination offsets the new
layout of ``dst``, which is its kept tokens followed by what it receives in transfer order. A
runtime gathers them into one all-to-all; ``inverse()`` is the plan that moves them back.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterable

from megatron_slim.plan.cp.layout import CPPlan
from megatron_slim.plan.cp.topology import CPTopology


@dataclass(frozen=True)
class Transfer:
    src: int
    src_start: int
    src_end: int
    dst: int
    dst_start: int
    dst_end: int
    intra_node: bool

    @property
    def tokens(self) -> int:
        return self.src_end - self.src_start


@dataclass(frozen=True)
class RemapPlan:
    source_tokens: tuple[int, ...]  # per rank, in the source layout
    target_tokens: tuple[int, ...]  # per rank, in the destination layout
    keep: tuple[int, ...]  # rank r keeps local tokens [0, keep[r]) at the same offsets
    transfers: tuple[Transfer, ...]

    @property
    def num_ranks(self) -> int:
        return len(self.source_tokens)

    @property
    def moved_tokens(self) -> int:
        return sum(t.tokens for t in self.transfers)

    @property
    def inter_node_tokens(self) -> int:
        return sum(t.tokens for t in self.transfers if not t.intra_node)

    def inverse(self) -> "RemapPlan":
        back = tuple(
            Transfer(t.dst, t.dst_start, t.dst_end, t.src, t.src_start, t.src_end, t.intra_node) for t in self.transfers
        )
        return RemapPlan(self.target_tokens, self.source_tokens, self.keep, back)

    def send_counts(self) -> tuple[tuple[int, ...], ...]:
        """``counts[src][dst]``: tokens of the all-to-all (the split sizes a runtime passes)."""
        counts = [[0] * self.num_ranks for _ in range(self.num_ranks)]
        for t in self.transfers:
            counts[t.src][t.dst] += t.tokens
        return tuple(tuple(row) for row in counts)

    def digest(self) -> str:
        text = ";".join(f"{t.src}:{t.src_start}-{t.src_end}>{t.dst}:{t.dst_start}-{t.dst_end}" for t in self.transfers)
        return hashlib.sha256(f"{self.source_tokens}|{self.target_tokens}|{text}".encode()).hexdigest()


def balanced_targets(tokens: tuple[int, ...]) -> tuple[int, ...]:
    total, n = sum(tokens), len(tokens)
    base, extra = divmod(total, n)
    bigger = set(sorted(range(n), key=lambda r: (-tokens[r], r))[:extra])
    return tuple(base + (r in bigger) for r in range(n))


def plan_remap(tokens: tuple[int, ...], topo: CPTopology) -> RemapPlan:
    """Remap from per-rank token counts ``tokens`` (the attention layout) to a balanced layout."""
    tokens = tuple(tokens)
    target = balanced_targets(tokens)
    keep = tuple(min(t, g) for t, g in zip(tokens, target))
    surplus = {r: [keep[r], tokens[r]] for r in range(len(tokens)) if tokens[r] > target[r]}  # [next, end)
    filled = list(keep)  # next free destination offset
    transfers: list[Transfer] = []

    def match(srcs: list[int], dsts: list[int]) -> None:
        for d in dsts:
            for s in srcs:
                need = target[d] - filled[d]
                if need == 0:
                    break
                lo, hi = surplus[s]
                n = min(need, hi - lo)
                if n:
                    transfers.append(Transfer(s, lo, lo + n, d, filled[d], filled[d] + n, topo.same_node(s, d)))
                    surplus[s][0] += n
                    filled[d] += n

    def open_srcs(ranks: Iterable[int]) -> list[int]:
        return [r for r in ranks if r in surplus and surplus[r][0] < surplus[r][1]]

    def open_dsts(ranks: Iterable[int]) -> list[int]:
        return [r for r in ranks if filled[r] < target[r]]

    for node in range(topo.num_nodes):
        ranks = topo.ranks_of_node(node)
        match(open_srcs(ranks), open_dsts(ranks))
    everyone = range(len(tokens))
    match(open_srcs(everyone), open_dsts(everyone))
    return RemapPlan(tokens, target, keep, tuple(transfers))


REMAPPED_PICKS = ("", "zeppelin", "zeppelin-spread")  # "": a plan no chooser made (a baseline engine's own)


def plan_remap_for(plan: CPPlan, topo: CPTopology) -> RemapPlan:
    """A Zeppelin plan that kept a baseline engine's placement or its own unremapped one
    (``plan.picked``, ``choose.py``) runs the MLP in the attention layout: the identity (nothing
    moves)."""
    tokens = plan.tokens_per_rank()
    if plan.picked not in REMAPPED_PICKS:
        return RemapPlan(tokens, tokens, tokens, ())
    return plan_remap(tokens, topo)
