"""Zigzag chunking and the causal work of every chunk pair, for lengths of any size.

A sequence of ``s`` tokens on a ring of ``g`` members is cut into ``2g`` chunks with boundaries
``b_k = floor(k * s / (2g))``: sizes differ by at most one token, and when ``s < 2g`` some chunks
are empty (the plan then lists no segment for them; the member still takes part in the ring).
Member ``i`` holds chunks ``i`` and ``2g-1-i``; pairing an early with a late chunk gives every
member the same causal work up to rounding.
"""

from __future__ import annotations

from typing import Iterable


def chunk_bounds(length: int, parts: int) -> tuple[int, ...]:
    """``parts + 1`` boundaries ``floor(k * length / parts)``."""
    return tuple(k * length // parts for k in range(parts + 1))


def zigzag_chunks(member: int, ring: int) -> tuple[int, int]:
    return member, 2 * ring - 1 - member


def causal(n: int) -> int:
    """Query-key pairs of ``n`` tokens attending causally to themselves (diagonal included)."""
    return n * (n + 1) // 2


def chunk_pairs(bounds: tuple[int, ...], q: int, k: int) -> int:
    """Causal pairs of query chunk ``q`` against key chunk ``k`` of one sequence."""
    nq = bounds[q + 1] - bounds[q]
    if k < q:
        return nq * (bounds[k + 1] - bounds[k])
    return causal(nq) if k == q else 0


def step_pairs(length: int, ring: int, member: int, origin: int) -> int:
    """Pairs member ``member`` computes for one sequence with the K/V block of member ``origin``."""
    b = chunk_bounds(length, 2 * ring)
    return sum(chunk_pairs(b, q, k) for q in zigzag_chunks(member, ring) for k in zigzag_chunks(origin, ring))


def member_prefix_pairs(length: int, ring: int, member: int) -> int:
    """Pairs of a member's two query chunks against the whole sequence (the all-gather engine)."""
    b = chunk_bounds(length, 2 * ring)
    total = 0
    for q in zigzag_chunks(member, ring):
        n = b[q + 1] - b[q]
        total += n * b[q] + causal(n)
    return total


def member_ranges(length: int, ring: int, member: int) -> tuple[tuple[int, int, int], ...]:
    """``(chunk, start, end)`` of the member's two chunks, empty ones left out."""
    b = chunk_bounds(length, 2 * ring)
    out = []
    for c in zigzag_chunks(member, ring):
        if b[c + 1] > b[c]:
            out.append((c, b[c], b[c + 1]))
    return tuple(out)


def hierarchical_ranges(
    length: int, nodes: int, per_node: int, node: int, local: int
) -> tuple[tuple[int, int, int, int], ...]:
    """``(chunk, part, start, end)``: part ``local`` of each of the node's two zigzag chunks."""
    b = chunk_bounds(length, 2 * nodes)
    out = []
    for c in zigzag_chunks(node, nodes):
        sub = chunk_bounds(b[c + 1] - b[c], per_node)
        start, end = b[c] + sub[local], b[c] + sub[local + 1]
        if end > start:
            out.append((c, local, start, end))
    return tuple(out)


def contiguous_ranges(lengths: Iterable[int], parts: int, part: int) -> tuple[tuple[int, int, int], ...]:
    """``(seq, start, end)`` of slice ``part`` of ``parts`` equal contiguous slices of the pack."""
    lengths = tuple(lengths)
    total = sum(lengths)
    lo, hi = part * total // parts, (part + 1) * total // parts
    out, offset = [], 0
    for i, s in enumerate(lengths):
        a, b = max(lo, offset), min(hi, offset + s)
        if b > a:
            out.append((i, a - offset, b - offset))
        offset += s
    return tuple(out)
