"""What one slice of a sample costs: forward and backward seconds, memory bytes.

A slice of ``length`` tokens that starts ``prefix`` tokens into its document attends to the
prefix (kept as K/V) and causally to itself: ``pairs = length * prefix + length * (length + 1) / 2``
query-key pairs. Its time is ``per_token * length + per_pair * pairs``, with separate forward and
backward figures because backward is ~2x forward for GEMMs but ~2.5x (3.5x with recompute) for
attention. The figures are fitted to ``CostModel.forward_time`` / ``backward_time`` (the latter
includes the recipe's recomputation) on a middle pipeline stage, so they are per-stage seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from megatron_slim.plan.cost.model import CostModel


def causal_pairs(length: float, prefix: float) -> float:
    return length * prefix + length * (length + 1) / 2


@dataclass(frozen=True)
class SliceCosts:
    """Per-stage linear and quadratic coefficients of a slice, forward and backward apart.

    ``kv_transfer_per_token``: seconds to receive one prefix token's K/V from another DP rank
    (what a piece pays when earlier tokens of its document ran on another replica: DP-merge).
    """

    fwd_per_token: float
    fwd_per_pair: float
    bwd_per_token: float
    bwd_per_pair: float
    bytes_per_token: float
    kv_transfer_per_token: float = 0.0

    def forward(self, length: float, prefix: float) -> float:
        return self.fwd_per_token * length + self.fwd_per_pair * causal_pairs(length, prefix)

    def backward(self, length: float, prefix: float) -> float:
        return self.bwd_per_token * length + self.bwd_per_pair * causal_pairs(length, prefix)

    def memory(self, length: float) -> float:
        return self.bytes_per_token * length

    def transfer(self, prefix: float) -> float:
        return self.kv_transfer_per_token * prefix

    def longest_within(self, work: float, prefix: float) -> int:
        """The most tokens a slice at ``prefix`` may hold for its forward+backward to cost at most
        ``work`` (at least one): the root of ``(a + c (prefix + 1/2)) n + (c / 2) n**2 = work``."""
        a = self.fwd_per_token + self.bwd_per_token
        c = self.fwd_per_pair + self.bwd_per_pair
        linear = a + c * (prefix + 0.5)
        if c <= 0:
            return max(1, int(work / linear)) if linear > 0 else 1 << 62
        return max(1, int((math.sqrt(linear * linear + 2 * c * work) - linear) / c))

    def sample_work(self, length: float) -> tuple[float, float]:
        """(forward, backward) seconds of a whole sample on one rank: its slices' causal pairs
        add up to the whole sample's, wherever it is cut."""
        pairs = causal_pairs(length, 0.0)
        return (
            self.fwd_per_token * length + self.fwd_per_pair * pairs,
            self.bwd_per_token * length + self.bwd_per_pair * pairs,
        )


def _fit(time: Callable[[float, float], float], tokens: float, prefix: float) -> tuple[float, float]:
    first, late = float(time(tokens, 0.0)), float(time(tokens, prefix))
    per_pair = (late - first) / (tokens * prefix)
    per_token = (first - per_pair * causal_pairs(tokens, 0.0)) / tokens
    return max(per_token, 0.0), max(per_pair, 0.0)


def fit_slice_costs(cost: CostModel, slice_tokens: int, longest: int) -> SliceCosts:
    """Fit the coefficients at a slice of ``slice_tokens`` placed first and ``longest`` tokens in.

    Memory is the activation a slice keeps from forward to backward plus the K/V it leaves in the
    cache, per token (both are linear in the slice's length)."""
    stage = min(1, cost.num_stages - 1)
    prefix = float(max(longest, 2 * slice_tokens))
    f_tok, f_pair = _fit(lambda n, p: cost.forward_time(stage, n, p), slice_tokens, prefix)
    b_tok, b_pair = _fit(lambda n, p: cost.backward_time(stage, n, p), slice_tokens, prefix)
    memory = cost.activation_bytes(stage, slice_tokens) + cost.kv_bytes(stage, slice_tokens)
    dp = cost.recipe.parallel.dp
    link = cost.link(cost.gpu_index(), cost.gpu_index(dp=min(1, dp - 1)))
    kv_per_token = cost.kv_bytes(stage, 1.0)
    return SliceCosts(f_tok, f_pair, b_tok, b_pair, memory / slice_tokens, kv_per_token / link.bandwidth)
