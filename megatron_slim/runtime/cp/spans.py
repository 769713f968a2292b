"""Where a plan's tokens sit in a rank's buffers: runs of one sequence's positions, with rows.

A ``Span`` is a run ``[start, end)`` of sequence ``seq``'s positions stored in buffer rows
``[row, row + length)``. A ``Block`` is a buffer's spans in row order (rows consecutive from 0):
a rank's tokens of one group, the K/V block travelling on a ring, or a node's tokens after the
head all-to-all. Everything here is plain Python read from the ``CPPlan``, so every rank can
compute any other rank's blocks without asking it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from megatron_slim.plan.cp.layout import CPPlan, Segment


@dataclass(frozen=True)
class Span:
    seq: int
    start: int
    end: int
    row: int

    @property
    def length(self) -> int:
        return self.end - self.start


Block = tuple[Span, ...]


def block_of(runs: Iterable[tuple[int, int, int]]) -> Block:
    """``(seq, start, end)`` runs laid out one after another from row 0 (empty runs dropped)."""
    out, row = [], 0
    for seq, start, end in runs:
        if end > start:
            out.append(Span(seq, start, end, row))
            row += end - start
    return tuple(out)


def block_rows(block: Block) -> int:
    return sum(s.length for s in block)


def concat(blocks: Iterable[Block]) -> Block:
    return block_of((s.seq, s.start, s.end) for b in blocks for s in b)


def group_segments(plan: CPPlan, rank: int, group: int) -> tuple[Segment, ...]:
    return tuple(s for s in plan.ranks[rank].segments if s.group == group)


def member_block(plan: CPPlan, rank: int, group: int) -> Block:
    """The tokens ``rank`` holds in ``group``, in its layout order."""
    return block_of((s.seq, s.start, s.end) for s in group_segments(plan, rank, group))


def group_rows(plan: CPPlan, rank: int, group: int) -> tuple[tuple[int, int], ...]:
    """``(first row, rows)`` runs of ``group``'s tokens inside ``rank``'s attention-layout buffer."""
    out: list[tuple[int, int]] = []
    row = 0
    for s in plan.ranks[rank].segments:
        if s.group == group and s.length:
            if out and out[-1][0] + out[-1][1] == row:
                out[-1] = (out[-1][0], out[-1][1] + s.length)
            else:
                out.append((row, s.length))
        row += s.length
    return tuple(out)


def rows_index(runs: Iterable[tuple[int, int]]) -> list[int]:
    return [r for first, n in runs for r in range(first, first + n)]
