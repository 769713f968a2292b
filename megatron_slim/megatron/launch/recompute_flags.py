"""Recomputation and offloading between a recipe and Megatron-LM's flags, both ways.

Megatron-LM (0.16-0.19) spells recomputation ``--recompute-granularity full|selective``,
``--recompute-method uniform|block``, ``--recompute-num-layers N`` and ``--recompute-modules M ...``
(``selective`` takes no method or layer count; unset modules mean ``core_attn``). It has no
per-slice activation offload ratio: ``--cpu-offloading-num-layers`` moves whole layers and refuses
pipeline parallelism and recomputation, ``--fine-grained-activation-offloading --offload-modules``
moves the inputs of named modules. A recipe's ``train.offload_ratio`` is therefore refused on the
Megatron-LM path. Imports no megatron and no torch.
"""

from __future__ import annotations

import argparse
from typing import Any

from megatron_slim.plan.recipe import TrainConfig
from megatron_slim.plan.recompute import DEFAULT_RECOMPUTE_MODULES, MODULES_MEGATRON_REFUSES_ON_LLAMA
from megatron_slim.plan.schema import ConfigError
from megatron_slim.plan.startup import MEGATRON_ARGS, Settings, check
from megatron_slim.plan.startup.rules_recompute import RECOMPUTE_RULES


def refuse_what_megatron_cannot_recompute(t: TrainConfig) -> None:
    check(Settings(offload_ratio=t.offload_ratio), MEGATRON_ARGS, RECOMPUTE_RULES)
    refused = [m for m in t.recompute_plan.modules if m in MODULES_MEGATRON_REFUSES_ON_LLAMA]
    if refused:
        raise ConfigError(
            f"train.recompute_modules: got {refused[0]!r}; Megatron-LM refuses it at start-up on a dense "
            "model without multi-latent attention (moe_act needs --moe-grouped-gemm, mla_up_proj "
            "--multi-latent-attention); allowed here: core_attn, layernorm, mlp, moe, shared_experts"
        )


def recompute_flags(t: TrainConfig) -> list[Any]:
    """The ``pretrain_gpt.py`` flags of ``train.recompute*`` (none for ``recompute: none``)."""
    plan = t.recompute_plan
    if plan.granularity == "full":
        return [
            "--recompute-granularity",
            "full",
            "--recompute-method",
            plan.method,
            "--recompute-num-layers",
            plan.num_layers,
        ]
    if plan.granularity == "selective":
        return ["--recompute-granularity", "selective", "--recompute-modules", *plan.modules]
    return []


def recompute_from_megatron_args(args: argparse.Namespace) -> dict[str, Any]:
    """The ``train.*`` recipe fields a parsed namespace's recompute flags stand for (the inverse
    of ``recompute_flags``; ``--recompute-activations`` is Megatron's alias for selective)."""
    granularity = getattr(args, "recompute_granularity", None)
    if granularity is None and getattr(args, "recompute_activations", False):
        granularity = "selective"
    if granularity == "full":
        return {
            "recompute": "full",
            "recompute_method": getattr(args, "recompute_method", None) or "uniform",
            "recompute_num_layers": getattr(args, "recompute_num_layers", None) or 1,
        }
    if granularity == "selective":
        modules = getattr(args, "recompute_modules", None) or DEFAULT_RECOMPUTE_MODULES
        return {"recompute": "selective", "recompute_modules": list(modules)}
    return {"recompute": "none"}
