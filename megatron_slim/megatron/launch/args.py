"""What a parsed Megatron-LM argument namespace stands for: a recipe (for the cost model and the
CP engines' topology) and the start-up rules' ``Settings`` view.

Both the launcher's flag checks (``flags``) and the CP engine checks (``cp_checks``) read it; it
imports neither, so neither imports the other through it. Imports no megatron and no torch.
"""

from __future__ import annotations

import argparse
from typing import Any, Optional

from megatron_slim.megatron.launch.recompute_flags import recompute_from_megatron_args
from megatron_slim.plan.recipe import Recipe, recipe_from_dict
from megatron_slim.plan.startup.settings import NO_CP_ENGINE, Settings


def recipe_from_megatron_args(args: argparse.Namespace) -> Recipe:
    """The recipe a parsed Megatron-LM argument namespace stands for (what the cost model needs for
    balanced slices and what the simulator would be given for the same run)."""
    heads = args.num_attention_heads
    groups = args.num_query_groups if getattr(args, "group_query_attention", False) and args.num_query_groups else heads
    vocab = getattr(args, "padded_vocab_size", None) or getattr(args, "vocab_size", None) or 32000
    vpp = getattr(args, "virtual_pipeline_model_parallel_size", None) or 1
    dp = getattr(args, "data_parallel_size", None) or 1
    data = {
        "name": "megatron-args",
        "hardware": args.slimpipe_hardware,
        "model": {
            "num_layers": args.num_layers,
            "hidden_size": args.hidden_size,
            "ffn_hidden_size": args.ffn_hidden_size or 4 * args.hidden_size,
            "num_attention_heads": heads,
            "num_query_groups": groups,
            "vocab_size": vocab,
            "seq_length": args.seq_length,
            "rotary_base": float(getattr(args, "rotary_base", 10000) or 10000),
        },
        "parallel": {
            "tp": args.tensor_model_parallel_size,
            "pp": args.pipeline_model_parallel_size,
            "vpp": vpp,
            "cp": args.context_parallel_size or 1,
            "dp": dp,
            "sequence_parallel": bool(getattr(args, "sequence_parallel", False))
            and args.tensor_model_parallel_size > 1,
        },
        "train": {
            "global_batch_size": args.global_batch_size or args.micro_batch_size * dp,
            "micro_batch_size": args.micro_batch_size,
            "precision": "bf16" if getattr(args, "bf16", False) or getattr(args, "fp16", False) else "fp32",
            **recompute_from_megatron_args(args),
        },
        "schedule": {
            "kind": "slimpipe",
            "num_slices": args.slimpipe_num_slices,
            "slice_policy": args.slimpipe_slice_policy,
            "vocab_parallel": bool(getattr(args, "slimpipe_vocab_parallel", False)),
        },
    }
    return recipe_from_dict(data)


def settings_from_megatron_args(args: argparse.Namespace) -> Settings:
    """The start-up rules' view of a parsed Megatron-LM namespace (a flag it lacks keeps its default)."""

    def flag(name: str, default: Any = None) -> Any:
        value = getattr(args, name, default)
        return default if value is None else value

    return Settings(
        cp=flag("context_parallel_size", 1),
        tp=flag("tensor_model_parallel_size", 1),
        pp=flag("pipeline_model_parallel_size", 1),
        vpp=flag("virtual_pipeline_model_parallel_size", 1),
        micro_batch_size=flag("micro_batch_size", 1),
        sequence_parallel=bool(flag("sequence_parallel")),
        cp_engine=flag("cp_engine", NO_CP_ENGINE),
        cp_remap=bool(flag("cp_remap")),
        slimpipe=bool(flag("use_slimpipe")),
        num_slices=flag("slimpipe_num_slices", 1),
        slice_policy=flag("slimpipe_slice_policy", "uniform"),
        vocab_parallel=bool(flag("slimpipe_vocab_parallel")),
        precision="bf16" if flag("bf16") else ("fp16" if flag("fp16") else "fp32"),
        seq_length=flag("seq_length", 0),
        recompute=flag("recompute_granularity"),
        recompute_method=flag("recompute_method"),
        offload_ratio=float(flag("slimpipe_offload_ratio", 0.0)),
        hierarchical_cp_sizes=flag("hierarchical_context_parallel_sizes"),
        cp_comm_type=flag("cp_comm_type"),
        hybrid_cp=bool(flag("hybrid_context_parallel")),
        partial_checkpoints=flag("num_microbatches_with_partial_activation_checkpoints"),
        reset_attention_mask=bool(flag("reset_attention_mask")),
        reset_position_ids=bool(flag("reset_position_ids")),
        num_experts=flag("num_experts"),
        multi_latent_attention=bool(flag("multi_latent_attention")),
        cuda_graph_impl=flag("cuda_graph_impl"),
        enable_cuda_graph=bool(flag("enable_cuda_graph")),
        external_cuda_graph=bool(flag("external_cuda_graph")),
        mtp_num_layers=flag("mtp_num_layers"),
        sequence_packing=bool(flag("sequence_packing") or flag("sequence_packing_scheduler")),
        position_embedding=flag("position_embedding_type"),
        attention_dropout=float(flag("attention_dropout", 0.0)),
        megatron_core=_installed_megatron_core(),
        packing=flag("slimpipe_packing", "none"),
        per_token_loss=bool(flag("calculate_per_token_loss")),
        dataloader_type=flag("dataloader_type"),
    )


def _installed_megatron_core() -> Optional[tuple[int, int]]:
    """(major, minor) of the installed megatron-core, read from its package metadata (no import of
    megatron or torch); None where it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        major, minor = version("megatron-core").split(".")[:2]
    except (PackageNotFoundError, ValueError):
        return None
    return int(major), int(minor.split("rc")[0])
