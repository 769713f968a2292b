"""Start-up rules on recomputation and offloading that a recipe's Megatron-LM flags cannot express."""

from __future__ import annotations

from megatron_slim.plan.startup.rule import Rule
from megatron_slim.plan.startup.settings import MEGATRON_ARGS

RECOMPUTE_RULES = [
    Rule(
        "megatron-offload",
        (MEGATRON_ARGS,),
        lambda s: s.offload_ratio > 0,
        lambda s, i: (
            f"train.offload_ratio: got {s.offload_ratio}; Megatron-LM 0.16-0.19 has no per-slice activation "
            "offload ratio (its --cpu-offloading-num-layers moves whole layers and refuses pipeline "
            "parallelism and recomputation; --fine-grained-activation-offloading moves named modules' "
            "inputs), so megatron-args cannot express it; allowed: 0 (the simulator prices other ratios)"
        ),
    ),
]
