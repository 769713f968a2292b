"""A recipe's recomputation (``plan.recompute.Recompute``) as megatron-core ``TransformerConfig``
fields: megatron-core's own ``TransformerBlock`` then checkpoints whole layers (full: uniform
groups or the first N layers of a chunk) or modules inside each layer (selective), exactly as
Megatron-LM's ``--recompute-*`` flags ask it to."""

from __future__ import annotations

from typing import Any

from megatron_slim.plan.recompute import Recompute


def recompute_config(plan: Recompute) -> dict[str, Any]:
    if plan.granularity == "full":
        return dict(recompute_granularity="full", recompute_method=plan.method, recompute_num_layers=plan.num_layers)
    if plan.granularity == "selective":
        return dict(recompute_granularity="selective", recompute_modules=list(plan.modules))
    return {}
