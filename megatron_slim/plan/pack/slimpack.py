"""SlimPack (arXiv 2509.26246): slices, MicroPacks balanced for forward and backward apart, DP-merge.

1. Units: a document is one unit (its slices of ``slice_tokens`` stay on one rank, in order, so
   its K/V cache stays local). An outlier -- longer than ``outlier_tokens``, by default any
   document worth more than half a rank's share of forward or backward work -- may instead be
   DP-merged: each slice a unit of its own, free to go to any replica, paying for the prefix K/V
   it receives. Three candidates (merge nothing, the outliers, or every sliced document) go
   through phase 1; the one with the lower imbalance wins, then the lower slowest rank (where
   DP-merge's transfers show). With context parallelism (``cp_route``), each outlier is first
   priced DP-merged and CP-routed -- whole on one replica, split over its CP group by Zeppelin's
   placement (``cp_route.py``) -- and takes the cheaper route ("whichever the cost model
   prefers"); the candidates then DP-merge the DP-routed outliers, and those plus every other
   sliced document. The plan records each outlier's route.
2. Phase 1 (``heuristic``): LPT + local search on ``max(F/F*, B/B*)``.
3. Phase 2 (``milp``): HiGHS refinement under ``budget_s``; kept only if the priced plan is
   better than phase 1's.
4. Each rank's units go into MicroPacks of at most the token/memory cap (``assemble.fill_rank``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from megatron_slim.plan.pack.assemble import Extras, Rank, cut, cut_balanced, effective_cap, fill_rank, price
from megatron_slim.plan.pack.costs import SliceCosts
from megatron_slim.plan.pack.cp_route import CPRoute, choose_routes
from megatron_slim.plan.pack.evaluate import plan_score
from megatron_slim.plan.pack.heuristic import Unit, Vector, local_search, lpt, normalised
from megatron_slim.plan.pack.milp import refine
from megatron_slim.plan.pack.plan import PackingPlan, Piece, Route
from megatron_slim.plan.schema import fail


@dataclass(frozen=True)
class SlimPackResult:
    plan: PackingPlan
    phase1: PackingPlan
    phase1_s: float
    total_s: float
    milp_rounds: int
    solver: str
    merged: tuple[int, ...]
    phase1_cpu_s: float = 0.0  # this process's CPU time (``time.process_time``) beside the wall clock
    total_cpu_s: float = 0.0


def make_units(
    lengths: Sequence[int],
    costs: SliceCosts,
    slices: list[list[Piece]],
    merged: set[int],
    memo: Optional[dict[tuple[int, bool], list[Unit]]] = None,
    routed: Optional[dict[int, tuple[float, float]]] = None,
) -> list[Unit]:
    """One unit per document, or per slice of a DP-merged one (``slices``: each document's).
    ``memo``: units already made for ``(sample, merged)``, shared by the DP-merge candidates;
    ``routed``: CP-routed documents' whole (forward, backward) seconds (one unit each, at that price)."""
    memo = {} if memo is None else memo
    routed = routed or {}
    units = []
    for sample, length in enumerate(lengths):
        key = (sample, sample in merged)
        if key not in memo:
            if sample in routed:
                memo[key] = [Unit(tuple(slices[sample]), *routed[sample])]
            else:
                memo[key] = _units_of(sample, length, costs, slices[sample], key[1])
        units += memo[key]
    return units


def _units_of(sample: int, length: int, costs: SliceCosts, pieces: list[Piece], merged: bool) -> list[Unit]:
    if not merged:
        return [Unit(tuple(pieces), *costs.sample_work(length))]
    units = []
    for p in pieces:
        moved = costs.transfer(p.start)
        fwd, bwd = costs.forward(p.length, p.start), costs.backward(p.length, p.start)
        units.append(Unit((p,), fwd + moved, bwd + 2 * moved))
    return units


@dataclass(frozen=True)
class Caps:
    dp: int
    cap: int  # tokens a MicroPack may hold under both caps
    token_cap: int
    memory_cap: float
    whole: bool = False  # whole samples: a sample's pieces that land on one rank run as one piece


def build(
    lengths: Sequence[int],
    units: list[Unit],
    assign: Sequence[int],
    costs: SliceCosts,
    caps: Caps,
    extras: Optional[Extras] = None,
) -> PackingPlan:
    # A DP-merged document's slices that land on one rank run there as one chain, in order.
    per_rank: list[dict[int, tuple[list[Piece], float]]] = [{} for _ in range(caps.dp)]
    for u, r in zip(units, assign):
        pieces, work = per_rank[r].get(u.pieces[0].sample, ([], 0.0))
        per_rank[r][u.pieces[0].sample] = (pieces + list(u.pieces), work + u.forward + u.backward)
    pack_work = costs.forward(caps.cap, 0) + costs.backward(caps.cap, 0)
    ranks: list[Rank] = []
    for chains in per_rank:
        ordered = [sorted(pieces) for pieces, _ in chains.values()]
        if caps.whole:
            ordered = [[Piece(c[0].sample, c[0].start, sum(p.length for p in c))] for c in ordered]
        ranks.append(fill_rank(ordered, [w for _, w in chains.values()], caps.cap, pack_work))
    return price("slimpack", lengths, ranks, costs, caps.token_cap, caps.memory_cap, extras)


def outliers(lengths: Sequence[int], costs: SliceCosts, dp: int, outlier_tokens: Optional[int]) -> set[int]:
    if outlier_tokens is not None:
        return {s for s, n in enumerate(lengths) if n > outlier_tokens}
    work = [costs.sample_work(n) for n in lengths]
    f_share = max(math.fsum(f for f, _ in work) / dp, 1e-300)
    b_share = max(math.fsum(b for _, b in work) / dp, 1e-300)
    return {s for s, (f, b) in enumerate(work) if max(f / f_share, b / b_share) > 0.5}


def route_outliers(
    lengths: Sequence[int], costs: SliceCosts, slices: list[list[Piece]], outliers: set[int], dp: int, cp: CPRoute
) -> dict[int, Route]:
    """Each outlier priced DP-merged (its slices' units) and CP-routed; ``cp_route.choose_routes``."""
    work = [math.fsum(costs.sample_work(n)) for n in lengths]
    by_dp = {}
    for s in outliers:
        by_dp[s] = math.fsum(u.forward + u.backward for u in _units_of(s, lengths[s], costs, slices[s], True))
    by_cp = {s: math.fsum(cp.sample_work(lengths[s])) for s in outliers}
    return choose_routes(sorted(outliers), work, by_dp, by_cp, dp)


def _best_candidate(
    lengths: Sequence[int],
    costs: SliceCosts,
    slices: list[list[Piece]],
    merges: list[set[int]],
    dp: int,
    routed: Optional[dict[int, tuple[float, float]]] = None,
) -> tuple[list[Unit], list[int], set[int]]:
    """Phase 1 for each DP-merge candidate (LPT for all, the local search for the best only); with
    CP-routed outliers (``routed``) only the given candidates, so every DP-routed one is merged."""
    options: list[set[int]] = [] if routed is not None else [set()]
    for m in merges:
        if m not in options:
            options.append(m)
    candidates: list[tuple[float, float, int, list[Unit], list[int], set[int], Vector, Vector]] = []
    memo: dict[tuple[int, bool], list[Unit]] = {}
    for merged in options:
        units = make_units(lengths, costs, slices, merged, memo, routed)
        f, b = normalised(units, dp)
        assign = lpt(f, b, dp)
        fwd, bwd = np.bincount(assign, f, dp), np.bincount(assign, b, dp)
        worst = max(float(fwd.max() / fwd.mean()), float(bwd.max() / bwd.mean()))
        raw = np.bincount(assign, [u.forward + u.backward for u in units], dp)
        # Balance first (as ``plan_score``); the slowest rank's work, DP-merge's transfers in it, breaks ties.
        candidates.append((worst, float(raw.max()), len(candidates), units, assign, merged, f, b))
    *_, units, assign, merged, f, b = min(candidates, key=lambda c: c[:3])
    return units, local_search(assign, f, b, dp), merged


def _phase1(
    lengths: Sequence[int],
    costs: SliceCosts,
    slices: list[list[Piece]],
    large: set[int],
    dp: int,
    cp_route: Optional[CPRoute],
    whole: bool = False,
) -> tuple[list[Unit], list[int], set[int], Extras]:
    """Phase 1's units and assignment, the DP-merged documents and what the plan prices apart."""
    every_sliced = {s for s, c in enumerate(slices) if len(c) > 1}
    if cp_route is not None and whole:
        routed = {s: cp_route.sample_work(lengths[s]) for s in large}  # DP-merge is not available
        units, assign, _ = _best_candidate(lengths, costs, slices, [set()], dp, routed)
        return units, assign, set(), Extras(routed=routed, routes=tuple((s, "cp") for s in sorted(large)))
    if cp_route is None:
        units, assign, merged = _best_candidate(lengths, costs, slices, [large, large | every_sliced], dp)
        return units, assign, merged, Extras()
    routes = route_outliers(lengths, costs, slices, large, dp, cp_route)
    routed = {s: cp_route.sample_work(lengths[s]) for s, r in routes.items() if r == "cp"}
    merge = large - set(routed)
    candidates = [merge, merge | (every_sliced - set(routed))]
    units, assign, merged = _best_candidate(lengths, costs, slices, candidates, dp, routed)
    return units, assign, merged, Extras(routed=routed, routes=tuple(sorted(routes.items())))


def _check_inputs(
    lengths: Sequence[int], dp: int, dp_merge: bool, whole_samples: bool, cp_route: Optional[CPRoute]
) -> None:
    if dp < 1:
        raise fail("packing dp", dp, "an integer >= 1")
    if not lengths or min(lengths) < 1:
        raise fail("packing lengths", list(lengths)[:8], "at least one sample, every length >= 1")
    if dp_merge and (not whole_samples or cp_route is not None):
        raise fail("packing dp_merge", dp_merge, "False, or True with whole_samples and no cp_route")


def _slices_and_outliers(
    lengths: Sequence[int],
    costs: SliceCosts,
    dp: int,
    caps: Caps,
    size: int,
    outlier_tokens: Optional[int],
    cp_route: Optional[CPRoute],
    dp_merge: bool,
) -> tuple[list[list[Piece]], set[int]]:
    """Each sample's slices, and the outliers ``solve``'s docstring says may be routed or merged."""
    if caps.whole:
        slices = [[Piece(s, 0, n)] for s, n in enumerate(lengths)]
    else:
        slices = [cut_balanced(s, n, size, costs) for s, n in enumerate(lengths)]
    large = outliers(lengths, costs, dp, outlier_tokens)
    if caps.whole:  # only a sample that fills a MicroPack alone is the pack its CP route prices
        large = {s for s in large if lengths[s] == caps.cap} if cp_route is not None else set()
        if dp_merge:
            large = {s for s in outliers(lengths, costs, dp, outlier_tokens) if lengths[s] > 1}
            for s in large:
                slices[s] = cut(s, lengths[s], -(-lengths[s] // 2))
    return slices, large


def solve(
    lengths: Sequence[int],
    costs: SliceCosts,
    dp: int,
    token_cap: int,
    memory_cap: float = math.inf,
    slice_tokens: Optional[int] = None,
    outlier_tokens: Optional[int] = None,
    budget_s: float = 0.5,
    whole_samples: bool = False,
    cp_route: Optional[CPRoute] = None,
    dp_merge: bool = False,
) -> SlimPackResult:
    """SlimPack's plan of ``lengths`` over ``dp`` ranks, with phase 1's plan beside it.

    ``whole_samples``: every sample stays one piece in one MicroPack (no slicing, no DP-merge), for a
    runtime that cannot carry a document's K/V from one microbatch to the next; samples must then
    fit the cap. ``cp_route``: the replicas' CP groups (cp > 1), so outliers may take the CP route.
    Both: DP-merge is unavailable, so every outlier that fills a MicroPack (``length == cap``: the pack
    Zeppelin's placement was priced for, no other sample, no padding) is CP-routed; other samples stay
    plain units. ``whole_samples`` and ``dp_merge`` (no ``cp_route``): each outlier may instead be cut in
    two halves, each a unit of its own (DP-merge over two replicas, ``dp_merge.py``); halves that land on
    one rank run there as the whole sample again."""
    began, began_cpu = time.perf_counter(), time.process_time()
    _check_inputs(lengths, dp, dp_merge, whole_samples, cp_route)
    caps = Caps(dp, effective_cap(costs, token_cap, memory_cap), token_cap, memory_cap, whole_samples)
    size = min(slice_tokens or caps.cap, caps.cap)
    if size < 1:
        raise fail("packing slice_tokens", slice_tokens, f"an integer in 1..{caps.cap}")
    if whole_samples and max(lengths) > caps.cap:
        raise fail("packing lengths", max(lengths), f"samples of at most {caps.cap} tokens with whole_samples")
    slices, large = _slices_and_outliers(lengths, costs, dp, caps, size, outlier_tokens, cp_route, dp_merge)
    units, assign, merged, extras = _phase1(lengths, costs, slices, large, dp, cp_route, whole_samples)
    first = build(lengths, units, assign, costs, caps, extras)
    phase1_s, phase1_cpu_s = time.perf_counter() - began, time.process_time() - began_cpu
    f, b = normalised(units, dp)
    refined = refine(assign, f, b, dp, max(0.0, budget_s - phase1_s))
    plan = first
    if refined.rounds_taken:
        second = build(lengths, units, refined.assign, costs, caps, extras)
        if plan_score(second) < plan_score(first):
            plan = second
    return SlimPackResult(
        plan,
        first,
        phase1_s,
        time.perf_counter() - began,
        refined.rounds_taken,
        refined.solver,
        tuple(sorted(merged)),
        phase1_cpu_s,
        time.process_time() - began_cpu,
    )
