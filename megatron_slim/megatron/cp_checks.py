"""Start-up checks for ``--cp-engine`` (megatron-slim's CP engines) on a parsed Megatron-LM namespace.

``check_cp_args(args)`` is meant to run inside ``flags.check_megatron_args`` right after Megatron
parses its flags, before any model exists; it does nothing unless ``--cp-engine`` is not ``te`` and
``--context-parallel-size > 1`` (the combinations with ``--use-slimpipe`` and a CP size of 1 are
``check_megatron_args``'s own). Each rejection says why and what to change. Imports no torch.
"""
from __future__ import annotations

import argparse
from typing import Any

from megatron_slim.plan.schema import ConfigError

POSITION_EMBEDDINGS = ("rope", "learned_absolute", "none")


def _on(args: argparse.Namespace, name: str) -> Any:
    return getattr(args, name, None)


def _cp_comm_type_set(value: Any) -> bool:
    values = value if isinstance(value, (list, tuple)) else [value]
    return any(v not in (None, "p2p") for v in values)


def check_cp_args(args: argparse.Namespace) -> None:
    engine = getattr(args, "cp_engine", "te")
    if engine in (None, "te") or (getattr(args, "context_parallel_size", 1) or 1) == 1 or _on(args, "use_slimpipe"):
        return
    flag = f"--cp-engine {engine}"
    tp = _on(args, "tensor_model_parallel_size") or 1
    problems = [
        ((_on(args, "micro_batch_size") or 1) != 1,
         f"{flag} plans one pack per microbatch: set --micro-batch-size 1 (pack documents instead)"),
        ((_on(args, "pipeline_model_parallel_size") or 1) > 1,
         f"{flag} needs --pipeline-model-parallel-size 1: Megatron's schedules send fixed [seq/cp] shapes between "
         "stages and middle stages never call get_batch, so they could not follow each microbatch's plan"),
        (bool(_on(args, "sequence_parallel")) and tp > 1,
         f"{flag} with --sequence-parallel and TP > 1 is not supported: a plan gives CP ranks token counts that "
         "need not divide by TP (and --cp-remap moves whole CP-rank layouts); drop --sequence-parallel"),
        (_on(args, "cuda_graph_impl") not in (None, "none") or bool(_on(args, "enable_cuda_graph"))
         or bool(_on(args, "external_cuda_graph")),
         f"{flag} cannot run under CUDA graphs (plans change every microbatch; graph replays bypass the remap "
         "layer's forward): set --cuda-graph-impl none"),
        (bool(_on(args, "hybrid_context_parallel")),
         f"{flag} replaces Megatron's hybrid context parallelism: drop --hybrid-context-parallel"),
        (bool(_on(args, "hierarchical_context_parallel_sizes")),
         f"{flag} takes its node layout from the hardware profile (--slimpipe-hardware): drop "
         "--hierarchical-context-parallel-sizes"),
        (_cp_comm_type_set(_on(args, "cp_comm_type")),
         f"{flag} chooses the CP communication itself: drop --cp-comm-type"),
        (bool(_on(args, "num_experts")),
         f"{flag} does not support MoE: the auxiliary losses are scaled as if every CP rank held seq/cp tokens; "
         "drop --num-experts"),
        (bool(_on(args, "mtp_num_layers")),
         f"{flag} does not support multi-token prediction (it shifts tokens across Megatron's zigzag split): "
         "drop --mtp-num-layers"),
        (bool(_on(args, "multi_latent_attention")),
         f"{flag} does not support MLA: drop --multi-latent-attention"),
        (_on(args, "position_embedding_type") not in (None,) + POSITION_EMBEDDINGS,
         f"{flag} computes positions per sequence for --position-embedding-type {' | '.join(POSITION_EMBEDDINGS)}; "
         f"got {_on(args, 'position_embedding_type')}"),
        (float(_on(args, "attention_dropout") or 0.0) != 0.0,
         f"{flag}: megatron-slim's core attention has no dropout: set --attention-dropout 0"),
        (bool(_on(args, "reset_position_ids")) != bool(_on(args, "reset_attention_mask")),
         f"{flag} attends within the documents it reads from position-id resets: pass --reset-position-ids "
         "and --reset-attention-mask together (or neither: each row is then one sequence)"),
    ]
    for bad, message in problems:
        if bad:
            raise ConfigError(message)
    _check_engine_fits(args, engine)


def _check_engine_fits(args: argparse.Namespace, engine: str) -> None:
    """Head counts the engine needs (ulysses: heads per TP rank divisible by cp; a2a+p2p: by the CP
    ranks of a node), on the topology of the hardware profile."""
    from megatron_slim.megatron.args import recipe_from_megatron_args
    from megatron_slim.plan.cp.costs import CPCosts
    from megatron_slim.plan.cp.engines import check_supported
    from megatron_slim.plan.cp.topology import CPTopology

    recipe = recipe_from_megatron_args(args)
    p = recipe.parallel
    check_supported(engine, CPTopology.from_hardware(recipe.hardware_profile, p.cp, p.tp), CPCosts.from_recipe(recipe))
