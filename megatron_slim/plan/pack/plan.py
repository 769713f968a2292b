"""The packing plan value: which pieces of which samples form each MicroPack, on which DP rank.

``ranks[r]`` is DP rank ``r``'s MicroPacks in pipeline order; a MicroPack is a list of pieces
``(sample, start, length)``. A document cut into pieces keeps its K/V between them, so on one
rank its pieces appear in start order. Forward and backward seconds are per pipeline stage, as
priced when the plan was built. The plan checks itself on construction: every token of every
sample exactly once, no MicroPack over the token cap or the memory cap.

``routes``: with context parallelism (cp > 1), each outlier's route, ``(sample, "cp" | "dp-merge")``
by sample: ``cp`` keeps it on one DP replica, split over the replica's CP group by Zeppelin's
placement (``cp_route.py``: its MicroPacks are priced so, and the simulator times them so);
``dp-merge`` lets its slices go to any replica. Empty without CP (nothing to choose).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Literal

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


Route = Literal["cp", "dp-merge"]
ROUTES: tuple[Route, ...] = ("cp", "dp-merge")


def _check_routes(plan: "PackingPlan") -> None:
    """Routes by increasing sample, each a sample of the plan and a known route; a CP-routed sample
    on one DP rank only."""
    samples = [s for s, _ in plan.routes]
    if samples != sorted(set(samples)):
        raise ConfigError(f"packing plan: routes {plan.routes[:8]} are not by increasing sample, each once")
    for s, route in plan.routes:
        if route not in ROUTES or not 0 <= s < len(plan.sample_lengths):
            raise ConfigError(
                f"packing plan: route {s}:{route}: allowed a sample of 0..{len(plan.sample_lengths) - 1} "
                f"and a route of {' | '.join(ROUTES)}"
            )
    routed = plan.cp_routed()
    held = {(p.sample, r) for r, packs in enumerate(plan.ranks) for m in packs for p in m.pieces if p.sample in routed}
    for s in routed:
        ranks = sorted(r for t, r in held if t == s)
        if len(ranks) > 1:
            raise ConfigError(f"packing plan: CP-routed sample {s} sits on DP ranks {ranks} (allowed: one)")


@dataclass(frozen=True)
class PackingPlan:
    method: str
    sample_lengths: tuple[int, ...]
    token_cap: int
    memory_cap: float
    ranks: tuple[tuple[MicroPack, ...], ...]
    routes: tuple[tuple[int, Route], ...] = ()

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
        _check_routes(self)

    @property
    def dp(self) -> int:
        return len(self.ranks)

    def rank_forward(self) -> tuple[float, ...]:
        return tuple(math.fsum(m.forward_s for m in packs) for packs in self.ranks)

    def rank_backward(self) -> tuple[float, ...]:
        return tuple(math.fsum(m.backward_s for m in packs) for packs in self.ranks)

    def cp_routed(self) -> frozenset[int]:
        return frozenset(s for s, route in self.routes if route == "cp")

    def route_counts(self) -> dict[str, int]:
        """Outliers per route (every route named, zero included)."""
        return {route: sum(1 for _, r in self.routes if r == route) for route in ROUTES}

    def text(self) -> str:
        """One line per MicroPack: rank, index, seconds, then ``sample:start+length`` pieces; the
        outliers' routes on a line of their own when there are any."""
        lines = [f"packing {self.method} dp={self.dp} samples={len(self.sample_lengths)} cap={self.token_cap}"]
        if self.routes:
            lines.append("routes " + " ".join(f"{s}:{route}" for s, route in self.routes))
        for r, packs in enumerate(self.ranks):
            for m, pack in enumerate(packs):
                pieces = " ".join(f"{p.sample}:{p.start}+{p.length}" for p in pack.pieces)
                lines.append(f"r{r} m{m} fwd={pack.forward_s:.6g} bwd={pack.backward_s:.6g} | {pieces}")
        return "\n".join(lines) + "\n"

    def digest(self) -> str:
        return hashlib.sha256(self.text().encode()).hexdigest()[:16]
