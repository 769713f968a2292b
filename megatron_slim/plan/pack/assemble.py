"""Build a priced ``PackingPlan`` from pieces per rank, and the small steps every packer shares.

Pricing a piece: forward/backward of its length at its prefix (its start in the document). A
document whose pieces sit on several DP ranks (DP-merge, or a baseline's round-robin scattering
a long document's chunks) also pays for the prefix K/V it receives (forward) and the dK/dV it
sends back (backward). A context-parallel shard (Megatron hybrid CP) costs 1/k of its document,
head-tail balanced (a piece of a shard: its share by tokens), plus the other shards' K/V. A
CP-routed outlier (``cp_route.py``) costs its route's price, shared among its pieces as their
forward / backward work at their prefix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

from megatron_slim.plan.pack.costs import SliceCosts
from megatron_slim.plan.pack.plan import MicroPack, PackingPlan, Piece, Route
from megatron_slim.plan.schema import fail

Rank = list[list[Piece]]


def effective_cap(costs: SliceCosts, token_cap: int, memory_cap: float) -> int:
    """Tokens a MicroPack may hold under both caps."""
    if token_cap < 1:
        raise fail("packing token cap", token_cap, "an integer >= 1")
    if costs.bytes_per_token <= 0 or math.isinf(memory_cap):
        return token_cap
    by_memory = math.floor(memory_cap / costs.bytes_per_token)
    if by_memory < 1:
        raise fail("packing memory cap", memory_cap, f"at least {costs.bytes_per_token:.4g} bytes (one token)")
    return min(token_cap, by_memory)


def cut(sample: int, length: int, size: int) -> list[Piece]:
    """A sample in pieces of ``size`` tokens (the last one shorter)."""
    return [Piece(sample, s, min(size, length - s)) for s in range(0, length, size)]


def cut_balanced(sample: int, length: int, size: int, costs: SliceCosts) -> list[Piece]:
    """A sample in slices of at most ``size`` tokens that each cost at most a first slice of
    ``size`` tokens (SlimPipe's balanced slicing: later slices attend to more, so they are shorter)."""
    budget = costs.forward(size, 0) + costs.backward(size, 0)
    pieces = []
    start = 0
    while start < length:
        n = min(size, length - start, costs.longest_within(budget, start))
        pieces.append(Piece(sample, start, n))
        start += n
    return pieces


def round_robin(bins: Sequence[list[Piece]], dp: int) -> list[Rank]:
    ranks: list[Rank] = [[] for _ in range(dp)]
    for i, b in enumerate(bins):
        ranks[i % dp].append(b)
    return ranks


def spread_samples(ranks: Sequence[Rank]) -> set[int]:
    """Samples whose pieces sit on more than one DP rank."""
    seen: dict[int, int] = {}
    spread: set[int] = set()
    for r, packs in enumerate(ranks):
        for pack in packs:
            for p in pack:
                if seen.setdefault(p.sample, r) != r:
                    spread.add(p.sample)
    return spread


@dataclass(frozen=True)
class Extras:
    """What some samples cost apart from their pieces' own work: ``shards`` (samples cut into that
    many hybrid-CP shards), ``routed`` (CP-routed samples' whole (forward, backward) seconds) and the
    ``routes`` the plan records."""

    shards: Mapping[int, int] = field(default_factory=dict)
    routed: Mapping[int, tuple[float, float]] = field(default_factory=dict)
    routes: tuple[tuple[int, Route], ...] = ()


def _piece_cost(
    costs: SliceCosts, p: Piece, lengths: Sequence[int], spread: set[int], extras: Extras
) -> tuple[float, float]:
    fwd, bwd = costs.forward(p.length, p.start), costs.backward(p.length, p.start)
    routed = extras.routed.get(p.sample)
    if routed:
        own_f, own_b = costs.sample_work(lengths[p.sample])
        return fwd * routed[0] / own_f if own_f else 0.0, bwd * routed[1] / own_b if own_b else 0.0
    k = extras.shards.get(p.sample)
    if k:
        whole = lengths[p.sample]
        fwd, bwd = costs.sample_work(whole)
        share = p.length / whole  # each of the k shards receives the other shards' K/V
        moved = costs.transfer(whole * (k - 1)) * share
        return fwd * share + moved, bwd * share + 2 * moved
    moved = costs.transfer(p.start) if p.sample in spread else 0.0
    return fwd + moved, bwd + 2 * moved


def price(
    method: str,
    lengths: Sequence[int],
    ranks: Sequence[Rank],
    costs: SliceCosts,
    token_cap: int,
    memory_cap: float,
    extras: Optional[Extras] = None,
) -> PackingPlan:
    """The plan value of ``ranks`` (each a list of MicroPacks' pieces), every MicroPack priced."""
    extras = extras or Extras()
    spread = spread_samples(ranks)
    out = []
    for packs in ranks:
        rank = []
        for pieces in packs:
            fb = [_piece_cost(costs, p, lengths, spread, extras) for p in pieces]
            tokens = sum(p.length for p in pieces)
            rank.append(
                MicroPack(tuple(pieces), math.fsum(f for f, _ in fb), math.fsum(b for _, b in fb), costs.memory(tokens))
            )
        out.append(tuple(rank))
    return PackingPlan(method, tuple(lengths), token_cap, memory_cap, tuple(out), extras.routes)


def fill_rank(units: Sequence[list[Piece]], weights: Sequence[float], cap: int, pack_work: float) -> Rank:
    """One rank's units (a document's pieces in order, or one piece) in MicroPacks of <= ``cap``
    tokens, as many as the tokens or the work (``pack_work`` each) need, heaviest unit first,
    each piece into the least-loaded MicroPack with room that does not precede its previous
    piece's (a document's K/V flows forward only)."""
    total = sum(p.length for u in units for p in u)
    count = max(1, -(-total // cap), math.ceil(math.fsum(weights) / pack_work - 1e-9) if pack_work > 0 else 1)
    packs: Rank = [[] for _ in range(count)]
    room = [cap] * count
    load = [0.0] * count
    for i in sorted(range(len(units)), key=lambda i: -weights[i]):
        unit = units[i]
        share = weights[i] / max(1, sum(p.length for p in unit))
        first = 0
        for p in unit:
            best = -1
            for m in range(first, len(packs)):
                if room[m] >= p.length and (best < 0 or load[m] < load[best]):
                    best = m
            if best < 0:
                packs.append([])
                room.append(cap)
                load.append(0.0)
                best = len(packs) - 1
            packs[best].append(p)
            room[best] -= p.length
            load[best] += share * p.length
            first = best
    return [pack for pack in packs if pack]
