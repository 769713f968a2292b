"""The packing plan value: which pieces of which samples form each MicroPack, on which DP rank.

``ranks[r]`` is DP rank ``r``'s MicroPacks in pipeline order; a MicroPack is a list of pieces
``(sample, start, length)``. A document cut into pieces keeps its K/V between them, so on one
rank its pieces appear in start order. Forward and backward seconds are per pipeline stage, as
priced when the plan was built. The plan checks itself on construction: every token of every
sample exactly once, no MicroPack over the token cap or the memory cap.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

from megatron_slim.plan.schema import ConfigError


@dataclass(frozen=True, order=True)
class Piece:
    sample: int
    start: int
    length: int


@dataclass(frozen=True)
class MicroPack:
    pieces: tuple[Piece, ...]
    forward_s: float
    backward_s: float
    memory_bytes: float

    @property
    def tokens(self) -> int:
        return sum(p.length for p in self.pieces)


def _check_cover(lengths: tuple[int, ...], pieces: list[Piece]) -> None:
    """Every token of every sample in exactly one piece."""
    pieces.sort(key=lambda p: (p.sample, p.start, p.length))  # Piece's own order, without its slow __lt__
    covered = [0] * len(lengths)
    for p in pieces:
        if not 0 <= p.sample < len(lengths) or p.length < 1:
            raise ConfigError(f"packing plan: piece {p} names no sample of 0..{len(lengths) - 1} or is empty")
        if p.start != covered[p.sample]:
            raise ConfigError(
                f"packing plan: sample {p.sample} piece at token {p.start}, expected {covered[p.sample]} "
                "(every token exactly once)"
            )
        covered[p.sample] += p.length
    for sample, (got, want) in enumerate(zip(covered, lengths)):
        if got != want:
            raise ConfigError(f"packing plan: sample {sample} covers {got} of its {want} tokens")


def _check_order(rank: int, packs: tuple[MicroPack, ...]) -> None:
    last: dict[int, int] = {}
    for pack in packs:
        for p in pack.pieces:
            if p.start < last.get(p.sample, -1):
                raise ConfigError(
                    f"packing plan: rank {rank} runs sample {p.sample} token {p.start} after a later piece"
                )
            last[p.sample] = p.start


@dataclass(frozen=True)
class PackingPlan:
    method: str
    sample_lengths: tuple[int, ...]
    token_cap: int
    memory_cap: float
    ranks: tuple[tuple[MicroPack, ...], ...]

    def __post_init__(self) -> None:
        if not self.ranks:
            raise ConfigError("packing plan: no DP rank (allowed: dp >= 1)")
        for r, packs in enumerate(self.ranks):
            for m, pack in enumerate(packs):
                if pack.tokens > self.token_cap:
                    raise ConfigError(
                        f"packing plan: rank {r} MicroPack {m} holds {pack.tokens} > cap {self.token_cap}"
                    )
                if pack.memory_bytes > self.memory_cap * (1 + 1e-9):
                    need, cap = f"{pack.memory_bytes:.4g}", f"{self.memory_cap:.4g}"
                    raise ConfigError(f"packing plan: rank {r} MicroPack {m} needs {need} B > cap {cap}")
            _check_order(r, packs)
        _check_cover(self.sample_lengths, [p for packs in self.ranks for m in packs for p in m.pieces])

    @property
    def dp(self) -> int:
        return len(self.ranks)

    def rank_forward(self) -> tuple[float, ...]:
        return tuple(math.fsum(m.forward_s for m in packs) for packs in self.ranks)

    def rank_backward(self) -> tuple[float, ...]:
        return tuple(math.fsum(m.backward_s for m in packs) for packs in self.ranks)

    def text(self) -> str:
        """One line per MicroPack: rank, index, seconds, then ``sample:start+length`` pieces."""
        lines = [f"packing {self.method} dp={self.dp} samples={len(self.sample_lengths)} cap={self.token_cap}"]
        for r, packs in enumerate(self.ranks):
            for m, pack in enumerate(packs):
                pieces = " ".join(f"{p.sample}:{p.start}+{p.length}" for p in pack.pieces)
                lines.append(f"r{r} m{m} fwd={pack.forward_s:.6g} bwd={pack.backward_s:.6g} | {pieces}")
        return "\n".join(lines) + "\n"

    def digest(self) -> str:
        return hashlib.sha256(self.text().encode()).hexdigest()[:16]
