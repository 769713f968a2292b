"""The packers SlimPack is compared with, producing the same plan value, priced the same way.

Every baseline packs whole documents; one longer than the MicroPack cap is first cut into
cap-sized chunks that open their own MicroPacks in order (a chain), and MicroPacks then go to DP
ranks round-robin, so a long document's chunks may land on several replicas and pay for the K/V
they receive (``assemble.price``).

* ``megatron``: Megatron-LM's ``DpBalancedScheduler`` (``megatron/core/datasets/data_schedule.py``
  at Megatron-LM d98e8a6, see shared/notes/slimpack.md; megatron-core 0.16.1 has no such class,
  its ``data_schedule.py`` holds only ``HybridCPDataLoaderWrapper``): order-preserving next-fit up
  to the token cap, MicroPack count padded to a multiple of dp by splitting MicroPacks, then
  round-robin over DP ranks. Token-only despite the name.
* ``bfd``: best-fit-decreasing, TRL's default ``pack_dataset(strategy="bfd")``: longest first,
  each into the fullest MicroPack with room.
* ``lpfhp``: longest-pack-first histogram packing (Krell et al., arXiv 2107.02027): lengths taken
  from the histogram longest first, each into the fullest pack with room, at most 12 per pack.
* ``hybrid_cp``: Megatron's ``BalancedCPScheduler`` (megatron-core 0.16.1
  ``megatron/core/pipeline_parallel/hybrid_cp_schedule.py``): a document needs
  ``max(1, 2**ceil(log2(s / cap)))`` GPUs, workload ``s**2 / cp``; greedy, heaviest first, onto
  the aligned group of that many ranks with the least workload (the bucket equalising, trimming
  and empty-GPU filling steps are left out). A shard is priced as ``1/cp`` of its document.
* ``wlb``: WLB-LLM (arXiv 2503.17924) outlier delay with workload-aware packing: documents over
  ``cap / 2`` tokens are the outliers, at most one per MicroPack (WLB-LLM delays the surplus to
  later iterations; one global batch is evaluated here, so the surplus opens new MicroPacks);
  the rest go heaviest first into the MicroPack with the least forward work that has room.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

from megatron_slim.plan.pack.assemble import Extras, Rank, cut, effective_cap, price, round_robin
from megatron_slim.plan.pack.costs import SliceCosts
from megatron_slim.plan.pack.plan import PackingPlan, Piece

Bins = list[list[Piece]]


def _chains(lengths: Sequence[int], cap: int, bins: Bins, room: list[int]) -> list[int]:
    """Cut every over-cap document into chained MicroPacks; return the documents left whole."""
    whole = []
    for s, n in enumerate(lengths):
        if n <= cap:
            whole.append(s)
            continue
        for p in cut(s, n, cap):
            bins.append([p])
            room.append(cap - p.length)
    return whole


def _split_to_multiple(bins: Bins, dp: int) -> Bins:
    bins = [b for b in bins if b]
    while len(bins) % dp:
        i = max(range(len(bins)), key=lambda j: len(bins[j]))
        if len(bins[i]) < 2:
            break
        half = len(bins[i]) // 2
        bins[i : i + 1] = [bins[i][:half], bins[i][half:]]
    return bins


def megatron(lengths: Sequence[int], cap: int, dp: int) -> list[Rank]:
    bins: Bins = [[]]
    room = [cap]
    for s, n in enumerate(lengths):
        for p in cut(s, n, cap):
            if p.length > room[-1]:
                bins.append([])
                room.append(cap)
            bins[-1].append(p)
            room[-1] -= p.length
    return round_robin(_split_to_multiple(bins, dp), dp)


def _best_fit(lengths: Sequence[int], order: list[int], cap: int, bins: Bins, room: list[int], limit: int) -> None:
    for s in order:
        n = lengths[s]
        fits = [i for i in range(len(bins)) if room[i] >= n and len(bins[i]) < limit]
        if fits:
            i = min(fits, key=lambda j: room[j])
        else:
            bins.append([])
            room.append(cap)
            i = len(bins) - 1
        bins[i].append(Piece(s, 0, n))
        room[i] -= n


def bfd(lengths: Sequence[int], cap: int, dp: int, limit: int = 10**9) -> list[Rank]:
    bins: Bins = []
    room: list[int] = []
    whole = _chains(lengths, cap, bins, room)
    chain_bins = len(bins)
    # A chain's tail MicroPack takes no other document's piece that could precede its head.
    room[:chain_bins] = [0] * chain_bins
    _best_fit(lengths, sorted(whole, key=lambda s: -lengths[s]), cap, bins, room, limit)
    return round_robin(bins, dp)


def lpfhp(lengths: Sequence[int], cap: int, dp: int) -> list[Rank]:
    return bfd(lengths, cap, dp, limit=12)


def _gpus_needed(n: int, cap: int, dp: int) -> int:
    return min(dp, max(1, 2 ** math.ceil(math.log2(n / cap)))) if n > cap else 1


def hybrid_cp(lengths: Sequence[int], cap: int, dp: int) -> tuple[list[Rank], dict[int, int]]:
    work = [0.0] * dp
    held: list[list[Piece]] = [[] for _ in range(dp)]
    shards: dict[int, int] = {}
    for s in sorted(range(len(lengths)), key=lambda s: -lengths[s]):
        n = lengths[s]
        k = _gpus_needed(n, cap, dp)
        start = min(range(0, dp - k + 1, k), key=lambda g: max(work[g : g + k]))
        size = -(-n // k)
        for j, p in enumerate(cut(s, n, size)):
            held[start + j].append(p)
            work[start + j] += n * n / k
        if k > 1:
            shards[s] = len(cut(s, n, size))
    ranks: list[Rank] = []
    for pieces in held:
        packs: Bins = [[]]
        room = cap
        for p in pieces:
            for o in range(0, p.length, cap):
                piece = Piece(p.sample, p.start + o, min(cap, p.length - o))
                if piece.length > room:
                    packs.append([])
                    room = cap
                packs[-1].append(piece)
                room -= piece.length
        ranks.append([b for b in packs if b])
    return ranks, shards


def wlb(lengths: Sequence[int], cap: int, dp: int, costs: SliceCosts) -> list[Rank]:
    bins: Bins = []
    room: list[int] = []
    whole = _chains(lengths, cap, bins, room)
    room[: len(bins)] = [0] * len(bins)
    outliers = sorted((s for s in whole if lengths[s] > cap // 2), key=lambda s: -lengths[s])
    total = sum(lengths)
    needed = -(-total // cap)
    count = -(-needed // dp) * dp
    chains = len(bins)
    while len(bins) < count or len(bins) - chains < len(outliers):  # an empty MicroPack per outlier
        bins.append([])
        room.append(cap)
    load = [math.fsum(costs.forward(p.length, p.start) for p in b) for b in bins]
    free = [i for i in range(len(bins)) if not bins[i]]
    for i, s in zip(free, outliers):
        bins[i].append(Piece(s, 0, lengths[s]))
        room[i] -= lengths[s]
        load[i] += costs.forward(lengths[s], 0)
    rest = sorted((s for s in whole if lengths[s] <= cap // 2), key=lambda s: -lengths[s])
    for s in rest:
        n = lengths[s]
        fits = [i for i in range(len(bins)) if room[i] >= n]
        if not fits:
            bins.append([])
            room.append(cap)
            load.append(0.0)
            fits = [len(bins) - 1]
        i = min(fits, key=lambda j: load[j])
        bins[i].append(Piece(s, 0, n))
        room[i] -= n
        load[i] += costs.forward(n, 0)
    return round_robin([b for b in bins if b], dp)


def plan_baseline(
    method: str, lengths: Sequence[int], costs: SliceCosts, dp: int, token_cap: int, memory_cap: float = math.inf
) -> PackingPlan:
    """The plan of baseline ``method`` (one of ``BASELINES``)."""
    cap = effective_cap(costs, token_cap, memory_cap)
    simple: dict[str, Callable[[Sequence[int], int, int], list[Rank]]] = {
        "megatron": megatron,
        "bfd": bfd,
        "lpfhp": lpfhp,
    }
    if method in simple:
        return price(method, lengths, simple[method](lengths, cap, dp), costs, token_cap, memory_cap)
    if method == "hybrid_cp":
        ranks, shards = hybrid_cp(lengths, cap, dp)
        return price(method, lengths, ranks, costs, token_cap, memory_cap, Extras(shards=shards))
    if method == "wlb":
        return price(method, lengths, wlb(lengths, cap, dp, costs), costs, token_cap, memory_cap)
    raise ValueError(f"packing method {method!r}: allowed {', '.join(BASELINES)}")


BASELINES = ("megatron", "bfd", "lpfhp", "hybrid_cp", "wlb")
