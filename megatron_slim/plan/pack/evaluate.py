"""Score a packing plan: iteration time, tokens/s, padding share, forward and backward imbalance.

Pipeline model (per DP rank, 1F1B over ``pp`` stages of equal per-stage cost): a rank's time is
``sum_m (f_m + b_m) + (pp - 1) * max_m (f_m + b_m)`` -- every MicroPack passes each stage once,
and the fill/drain bubble is set by the largest one. The iteration waits for the slowest rank.
A DP-merged document's cross-rank K/V dependency is priced as transfer time, not as a wait.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from megatron_slim.plan.cp.lengths import LengthSource
from megatron_slim.plan.pack.plan import PackingPlan


@dataclass(frozen=True)
class PackingMetrics:
    iteration_time_s: float
    tokens_per_s: float
    padding_share: float
    fwd_imbalance: float
    bwd_imbalance: float
    micropacks: int


def imbalance(values: Sequence[float]) -> float:
    """max / mean (1.0 is perfect; an all-zero list counts as balanced)."""
    mean = math.fsum(values) / len(values)
    return max(values) / mean if mean > 0 else 1.0


def plan_score(plan: PackingPlan) -> tuple[float, float]:
    """What the solver minimises: the worse of the two imbalances, then the iteration time."""
    return max(imbalance(plan.rank_forward()), imbalance(plan.rank_backward())), rank_times(plan, 1)[0]


def rank_times(plan: PackingPlan, pp: int) -> tuple[float, ...]:
    def one(packs: Sequence[tuple[float, float]]) -> float:
        if not packs:
            return 0.0
        return math.fsum(f + b for f, b in packs) + (pp - 1) * max(f + b for f, b in packs)

    times = tuple(one([(m.forward_s, m.backward_s) for m in packs]) for packs in plan.ranks)
    return (max(times), *times)


def evaluate(plan: PackingPlan, pp: int = 1) -> PackingMetrics:
    if pp < 1:
        raise ValueError(f"pipeline stages pp={pp}: allowed an integer >= 1")
    slowest = rank_times(plan, pp)[0]
    tokens = sum(plan.sample_lengths)
    packs = sum(len(r) for r in plan.ranks)
    capacity = packs * plan.token_cap
    return PackingMetrics(
        iteration_time_s=slowest,
        tokens_per_s=tokens / slowest if slowest > 0 else math.inf,
        padding_share=1.0 - tokens / capacity if capacity else 0.0,
        fwd_imbalance=imbalance(plan.rank_forward()),
        bwd_imbalance=imbalance(plan.rank_backward()),
        micropacks=packs,
    )


def draw_global_batch(source: LengthSource, total_tokens: int, seed: int = 0) -> tuple[int, ...]:
    """Lengths drawn from ``source`` until they hold ``total_tokens``; the last one is cut to fit."""
    if total_tokens < 1:
        raise ValueError(f"global batch tokens={total_tokens}: allowed an integer >= 1")
    lengths: list[int] = []
    left = total_tokens
    for n in source.stream(seed):
        lengths.append(min(n, left))
        left -= lengths[-1]
        if not left:
            return tuple(lengths)
    raise AssertionError("a length stream is endless")
