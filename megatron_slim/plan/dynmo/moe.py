"""``dynmo.moe_experts`` / ``moe_topk`` / ``moe_drift``: the MoE model option and its synthetic drift (pure).

With ``moe_experts = E > 0`` every decoder layer's MLP is a mixture of ``E`` experts (each the size
of the dense MLP), each token routed to its ``moe_topk`` best by a learned router. Natural load
drift is slow on small runs, so ``moe_drift = d`` adds a bias to every router's logits that grows
linearly over training and tilts the load toward the higher-numbered experts:

    bias_e(t) = d * (t - 1) * (2 e / (E - 1) - 1)        (iteration t from 1; sums to 0 over e)
"""

from __future__ import annotations


def drift_bias(iteration: int, experts: int, drift: float) -> list[float]:
    """The logit bias per expert during ``iteration``."""
    return [drift * (iteration - 1) * (2 * e / (experts - 1) - 1) for e in range(experts)]
