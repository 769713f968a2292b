"""The recipe a parsed Megatron-LM argument namespace stands for.

Both the launcher's flag checks (``flags``) and the CP engine checks (``cp_checks``) read it; it
imports neither, so neither imports the other through it. Imports no megatron and no torch.
"""
from __future__ import annotations

import argparse

from megatron_slim.plan.recipe import Recipe, recipe_from_dict


def recipe_from_megatron_args(args: argparse.Namespace) -> Recipe:
    """The recipe a parsed Megatron-LM argument namespace stands for (what the cost model needs for
    balanced slices and what the simulator would be given for the same run)."""
    heads = args.num_attention_heads
    groups = args.num_query_groups if getattr(args, "group_query_attention", False) and args.num_query_groups else heads
    vocab = getattr(args, "padded_vocab_size", None) or getattr(args, "vocab_size", None) or 32000
    vpp = getattr(args, "virtual_pipeline_model_parallel_size", None) or 1
    dp = getattr(args, "data_parallel_size", None) or 1
    data = {
        "name": "megatron-args", "hardware": args.slimpipe_hardware,
        "model": {"num_layers": args.num_layers, "hidden_size": args.hidden_size,
                  "ffn_hidden_size": args.ffn_hidden_size or 4 * args.hidden_size, "num_attention_heads": heads,
                  "num_query_groups": groups, "vocab_size": vocab, "seq_length": args.seq_length,
                  "rotary_base": float(getattr(args, "rotary_base", 10000) or 10000)},
        "parallel": {"tp": args.tensor_model_parallel_size, "pp": args.pipeline_model_parallel_size, "vpp": vpp,
                     "cp": args.context_parallel_size or 1, "dp": dp,
                     "sequence_parallel": bool(getattr(args, "sequence_parallel", False)) and args.tensor_model_parallel_size > 1},
        "train": {"global_batch_size": args.global_batch_size or args.micro_batch_size * dp,
                  "micro_batch_size": args.micro_batch_size,
                  "precision": "bf16" if getattr(args, "bf16", False) or getattr(args, "fp16", False) else "fp32",
                  "recompute": "full" if getattr(args, "recompute_granularity", None) == "full" else "none"},
        "schedule": {"kind": "slimpipe", "num_slices": args.slimpipe_num_slices,
                     "slice_policy": args.slimpipe_slice_policy},
    }
    return recipe_from_dict(data)
