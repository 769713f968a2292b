"""Rows of a context-exchange block a CP rank ships under zigzag query-out CP, counted independently
of the runtime: each slice of ``length`` tokens is cut into ``2 * cp`` equal chunks and CP rank ``r``
holds chunks ``r`` and ``2cp - 1 - r``; a block's K/V range ``[start, end)`` of the sender's prefix
(uniform slices) is shipped by each rank as the tokens of it that rank holds."""


def zigzag_rows(cp_rank: int, cp: int, length: int, start: int, end: int) -> int:
    if cp == 1:
        return end - start
    chunk = length // (2 * cp)
    return sum((t % length) // chunk in (cp_rank, 2 * cp - 1 - cp_rank) for t in range(start, end))
