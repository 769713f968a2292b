"""Megatron's zigzag split of one sequence slice over the context-parallel ranks.

A slice of ``length`` tokens is cut into ``2 * cp`` equal chunks; CP rank ``r`` holds chunks ``r``
and ``2cp - 1 - r``, in that order (what ``get_batch_on_this_cp_rank`` does to whatever sequence the
forward step receives). Tensors gathered over the CP group come *rank-major* (rank 0's two chunks,
then rank 1's, ...); causal masking needs *position order*. ``ZigzagLayout`` converts between the
two along any dimension and names which query rows a local key chunk is seen by.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Tensor = torch.Tensor


@dataclass(frozen=True)
class ZigzagLayout:
    cp: int
    length: int  # tokens of the whole slice (all CP ranks together)

    def __post_init__(self) -> None:
        if self.cp < 1:
            raise ValueError(f"cp={self.cp}: allowed values are integers >= 1")
        if self.length <= 0 or self.length % (2 * self.cp):
            raise ValueError(
                f"slice length {self.length}: allowed values are positive multiples of "
                f"2*cp={2 * self.cp} (zigzag context-parallel chunks)"
            )

    @property
    def chunk(self) -> int:
        return self.length // (2 * self.cp)

    def own_chunks(self, rank: int) -> tuple[int, int]:
        """Chunk positions held by ``rank``, in its local order."""
        return rank, 2 * self.cp - 1 - rank

    def positions(self, rank: int) -> Tensor:
        """Token positions (within the slice) of ``rank``'s local tokens, in local order."""
        c = self.chunk
        return torch.cat([torch.arange(p * c, (p + 1) * c) for p in self.own_chunks(rank)])

    def to_positions(self, x: Tensor, dim: int) -> Tensor:
        """Rank-major ``x`` (``length`` along ``dim``) -> position order."""
        dim = dim % x.dim()
        parts = x.unflatten(dim, (self.cp, 2, self.chunk))
        first = parts.select(dim + 1, 0)  # chunk positions 0 .. cp-1
        second = parts.select(dim + 1, 1).flip(dim)  # chunk positions cp .. 2cp-1
        return torch.cat([first, second], dim).flatten(dim, dim + 1)

    def to_rank_major(self, x: Tensor, dim: int) -> Tensor:
        """Position-ordered ``x`` -> rank-major (inverse of :meth:`to_positions`)."""
        dim = dim % x.dim()
        chunks = x.unflatten(dim, (2 * self.cp, self.chunk))
        first = chunks.narrow(dim, 0, self.cp)
        second = chunks.narrow(dim, self.cp, self.cp).flip(dim)
        return torch.stack([first, second], dim + 1).flatten(dim, dim + 2)

    def key_blocks(self, rank: int) -> list[tuple[int, int, int, bool]]:
        """What ``rank``'s own chunks of this slice are seen by, as ``(local chunk, first query row,
        query rows, causal)`` in position order: the chunk's own rows with a causal square, every
        later row fully; earlier rows never see it."""
        c, blocks = self.chunk, []
        for t, p in enumerate(self.own_chunks(rank)):
            blocks.append((t, p * c, c, True))
            if (p + 1) * c < self.length:
                blocks.append((t, (p + 1) * c, self.length - (p + 1) * c, False))
        return blocks
