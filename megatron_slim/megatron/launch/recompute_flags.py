"""Recomputation and offloading between a recipe and Megatron-LM's flags, both ways.

Megatron-LM (0.16-0.19) spells recomputation ``--recompute-granularity full|selective``,
``--recompute-method uniform|block``, ``--recompute-num-layers N`` and ``--recompute-modules M ...``
(``selective`` takes no method or layer count; unset modules mean ``core_attn``). It has no
per-slice activation offload ratio (``--cpu-offloading-num-layers`` moves whole layers and refuses
pipeline parallelism and recomputation, ``--fine-grained-activation-offloading --offload-modules``
moves the inputs of named modules): a recipe's ``train.offload_ratio`` becomes megatron-slim's
``--slimpipe-offload-ratio``, which the SlimPipe schedule runs (``flags._schedule_flags``; the
start-up rules in ``plan/startup/rules_recompute`` refuse it elsewhere). Imports no megatron and no torch.
"""

from __future__ import annotations

import argparse
from typing import Any

from megatron_slim.plan.recipe import TrainConfig
from megatron_slim.plan.recompute import DEFAULT_RECOMPUTE_MODULES, MODULES_MEGATRON_REFUSES_ON_LLAMA
from megatron_slim.plan.schema import ConfigError


def refuse_what_megatron_cannot_recompute(t: TrainConfig) -> None:
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
    """The ``train.*`` recipe fields a parsed namespace's recompute and offload flags stand for (the
    inverse of ``recompute_flags`` and ``--slimpipe-offload-ratio``; ``--recompute-activations`` is
    Megatron's alias for selective)."""
    offload = {"offload_ratio": float(getattr(args, "slimpipe_offload_ratio", 0.0) or 0.0)}
    granularity = getattr(args, "recompute_granularity", None)
    if granularity is None and getattr(args, "recompute_activations", False):
        granularity = "selective"
    if granularity == "full":
        return {
            "recompute": "full",
            "recompute_method": getattr(args, "recompute_method", None) or "uniform",
            "recompute_num_layers": getattr(args, "recompute_num_layers", None) or 1,
            **offload,
        }
    if granularity == "selective":
        modules = getattr(args, "recompute_modules", None) or DEFAULT_RECOMPUTE_MODULES
        return {"recompute": "selective", "recompute_modules": list(modules), **offload}
    return {"recompute": "none", **offload}
