"""SlimPipe slices of a window that a CP engine planned once: who holds what, who attends to what.

The engine plans the window's documents (``CPPlan``: each rank's segments, fixed for the whole
window). A slice is a contiguous range of window positions; CP rank ``r`` holds the positions of
its planned segments that fall in the slice (``SliceShare.runs``, in position order), or one
padding row when it holds none there. Attention of a slice is "query-out" over the whole CP group:
every rank sees all the slice's queries (rank-major: rank 0's rows, then rank 1's, ...) and
attends them to the keys it holds itself -- its rows of this slice and its cached rows of the
window's earlier slices -- as ``AttentionPiece`` values; the partials then merge by log-sum-exp on
the rank that holds each query. Every (query, key) pair of one document with the key not after the
query is covered by exactly one piece of exactly one rank, which is what makes it exact for any
placement the engine picks.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from itertools import accumulate
from typing import Optional, Sequence

from megatron_slim.plan.cp.layout import CPPlan

OWN = -1  # a piece's keys are the slice's own local rows (else: index of an earlier, cached slice)
PADDING_ROWS = 1  # a rank that holds no token of a slice runs one row no piece reads or writes

Run = tuple[int, int]  # [first, end) window positions


@dataclass(frozen=True)
class SliceShare:
    """Slice ``[start, start + length)`` of a planned window: per CP rank, the window runs it holds."""

    start: int
    length: int
    runs: tuple[tuple[Run, ...], ...]

    def tokens(self, rank: int) -> int:
        return sum(end - first for first, end in self.runs[rank])

    def rows(self, rank: int) -> int:
        """Rows ``rank`` runs for this slice: its tokens, or the padding row."""
        return self.tokens(rank) or PADDING_ROWS

    def local_rows(self, rank: int) -> list[int]:
        """Slice-relative positions of ``rank``'s rows in local order (the padding row reads position 0)."""
        rows = [p - self.start for first, end in self.runs[rank] for p in range(first, end)]
        return rows or [0] * PADDING_ROWS

    def row_offsets(self) -> tuple[int, ...]:
        """First row of each rank in the rank-major concatenation of every rank's rows."""
        return tuple([0, *accumulate(self.rows(r) for r in range(len(self.runs)))][:-1])


@dataclass(frozen=True)
class AttentionPiece:
    """Query rows (rank-major slice rows) against rows of one local key source. ``documents`` set:
    a causal diagonal (queries are the keys) cut into those document lengths; else dense."""

    q_first: int
    q_rows: int
    source: int
    k_first: int
    k_rows: int
    documents: Optional[tuple[int, ...]] = None


def _merged(runs: list[Run]) -> tuple[Run, ...]:
    out: list[Run] = []
    for first, end in sorted(runs):
        if out and out[-1][1] == first:
            out[-1] = (out[-1][0], end)
        else:
            out.append((first, end))
    return tuple(out)


def slice_shares(plan: CPPlan, slice_lengths: Sequence[int]) -> tuple[SliceShare, ...]:
    """Each slice's share per CP rank of the window ``plan`` covers (``sum(slice_lengths)`` tokens)."""
    if sum(slice_lengths) != plan.pack_length:
        raise ValueError(
            f"slice lengths {list(slice_lengths)} cover {sum(slice_lengths)} tokens; allowed: lengths summing to "
            f"the planned window's {plan.pack_length} tokens"
        )
    held = [[(s.pack_start, s.pack_start + s.length) for s in r.segments] for r in plan.ranks]
    shares, start = [], 0
    for length in slice_lengths:
        end = start + length
        runs = tuple(
            _merged([(max(a, start), min(b, end)) for a, b in rank_runs if max(a, start) < min(b, end)])
            for rank_runs in held
        )
        shares.append(SliceShare(start, length, runs))
        start = end
    return tuple(shares)


@dataclass(frozen=True)
class _Documents:
    starts: tuple[int, ...]
    ends: tuple[int, ...]

    @staticmethod
    def of(lengths: Sequence[int]) -> "_Documents":
        ends = tuple(accumulate(lengths))
        return _Documents((0, *ends[:-1]), ends)

    def around(self, position: int) -> Run:
        d = bisect_right(self.starts, position) - 1
        return self.starts[d], self.ends[d]

    def cut(self, first: int, end: int) -> tuple[int, ...]:
        """Lengths of the documents' parts inside ``[first, end)``."""
        parts, at = [], first
        while at < end:
            stop = min(self.around(at)[1], end)
            parts.append(stop - at)
            at = stop
        return tuple(parts)


def _keyed_runs(share: SliceShare, rank: int) -> list[tuple[Run, int]]:
    """``rank``'s runs of ``share`` with their first local row."""
    out, row = [], 0
    for run in share.runs[rank]:
        out.append((run, row))
        row += run[1] - run[0]
    return out


def _earlier_piece(docs: _Documents, q: Run, q_row: int, k: Run, k_row: int, source: int) -> Optional[AttentionPiece]:
    """Keys ``k`` wholly before queries ``q``: only the document holding ``q``'s first query can see them."""
    doc_first, doc_end = docs.around(q[0])
    if doc_first >= k[1]:
        return None
    k_first = max(k[0], doc_first)
    q_end = min(doc_end, q[1])
    return AttentionPiece(q_row, q_end - q[0], source, k_row + k_first - k[0], k[1] - k_first)


def slice_pieces(shares: Sequence[SliceShare], index: int, rank: int, documents: Sequence[int]) -> list[AttentionPiece]:
    """``rank``'s pieces for slice ``index``: every rank's queries of the slice against the keys
    ``rank`` holds (its runs of this slice, source ``OWN``, and of each earlier slice, source ``i``)."""
    docs, share = _Documents.of(documents), shares[index]
    keys = [(run, row, i) for i in range(index) for run, row in _keyed_runs(shares[i], rank)]
    keys += [(run, row, OWN) for run, row in _keyed_runs(share, rank)]
    pieces: list[AttentionPiece] = []
    for q_rank, offset in enumerate(share.row_offsets()):
        for q, q_local in _keyed_runs(share, q_rank):
            for k, k_row, source in keys:
                if q_rank == rank and source == OWN and k == q:
                    pieces.append(AttentionPiece(offset + q_local, q[1] - q[0], OWN, k_row, k[1] - k[0], docs.cut(*q)))
                elif k[1] <= q[0]:
                    piece = _earlier_piece(docs, q, offset + q_local, k, k_row, source)
                    pieces += [piece] if piece is not None else []
    return pieces
