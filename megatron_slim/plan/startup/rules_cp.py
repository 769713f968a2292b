"""Start-up rules of the megatron-slim CP engines (``--cp-engine``, ``cp.engine``)."""

from __future__ import annotations

from typing import Callable

from megatron_slim.plan.startup.rule import Rule, cp_comm_type_set, engine_input
from megatron_slim.plan.startup.settings import LAUNCHER, NO_CP_ENGINE, TRAIN, Inputs, Settings

POSITION_EMBEDDINGS = ("rope", "learned_absolute", "none")


def _on_engine(
    name: str,
    broken: Callable[[Settings], bool],
    message: Callable[[Settings, Inputs], str],
    callers: tuple[str, ...] = (LAUNCHER,),
) -> Rule:
    """A rule for runs whose attention is a megatron-slim CP engine."""
    return Rule(name, callers, lambda s: s.cp_engine_runs and broken(s), message)


CP_ENGINE_RULES = [
    Rule(
        "cp-engine-needs-cp",
        (LAUNCHER,),
        lambda s: s.cp_engine != NO_CP_ENGINE and s.cp == 1,
        lambda s, i: f"{engine_input(s, i)}: needs --context-parallel-size > 1 (or drop --cp-engine)",
    ),
    Rule(
        "remap-needs-zeppelin",
        (LAUNCHER, TRAIN),
        lambda s: s.cp_remap and s.cp_engine != "zeppelin",
        lambda s, i: (
            f"{i.name('cp_remap')}: only with {i.setting('cp_engine', 'zeppelin')} (only Zeppelin has a "
            f"remapping layer; got {engine_input(s, i)})"
        ),
    ),
    _on_engine(
        "one-pack-per-microbatch",
        lambda s: s.micro_batch_size != 1,
        lambda s, i: (
            f"{engine_input(s, i)} plans one pack per microbatch: set {i.setting('micro_batch_size', 1)} "
            "(pack documents instead)"
        ),
        (LAUNCHER, TRAIN),
    ),
    _on_engine(
        "cp-engine-virtual-pipeline",
        lambda s: s.pp > 1 and s.vpp > 1,
        lambda s, i: (
            f"{engine_input(s, i)} with virtual pipeline stages ({i.name('vpp')} {s.vpp}) is not supported under "
            "Megatron-LM's launcher (the interleaved schedule runs a rank's chunks out of microbatch order, and "
            f"middle chunks read no batch); allowed: {i.setting('vpp', 1)} (megatron-slim train runs it)"
        ),
    ),
    _on_engine(
        "cp-engine-pipeline-recompute",
        lambda s: s.pp > 1 and s.recompute not in (None, "none"),
        lambda s, i: (
            f"{engine_input(s, i)} with {i.name('pp')} {s.pp} and activation recomputation "
            f"({s.recompute}): Megatron's 1F1B recomputes a microbatch's layers after later microbatches made "
            "their plans current, so the recomputed attention would run the wrong plan; allowed: no "
            f"recomputation, or {i.setting('pp', 1)}"
        ),
    ),
    _on_engine(
        "cp-engine-sequence-parallel",
        lambda s: s.sequence_parallel and s.tp > 1,
        lambda s, i: (
            f"{engine_input(s, i)} with --sequence-parallel and TP > 1 is not supported: a plan gives CP ranks token "
            "counts that need not divide by TP (and --cp-remap moves whole CP-rank layouts); drop --sequence-parallel"
        ),
    ),
    _on_engine(
        "cp-engine-cuda-graphs",
        lambda s: s.cuda_graphs,
        lambda s, i: (
            f"{engine_input(s, i)} cannot run under CUDA graphs (plans change every microbatch; graph replays bypass "
            "the remap layer's forward): set --cuda-graph-impl none"
        ),
    ),
    _on_engine(
        "cp-engine-hybrid-cp",
        lambda s: s.hybrid_cp,
        lambda s, i: (
            f"{engine_input(s, i)} replaces Megatron's hybrid context parallelism: drop --hybrid-context-parallel"
        ),
    ),
    _on_engine(
        "cp-engine-hierarchical-cp",
        lambda s: bool(s.hierarchical_cp_sizes),
        lambda s, i: (
            f"{engine_input(s, i)} takes its node layout from the hardware profile (--slimpipe-hardware): drop "
            "--hierarchical-context-parallel-sizes"
        ),
    ),
    _on_engine(
        "cp-engine-comm-type",
        lambda s: cp_comm_type_set(s.cp_comm_type),
        lambda s, i: f"{engine_input(s, i)} chooses the CP communication itself: drop --cp-comm-type",
    ),
    _on_engine(
        "cp-engine-moe",
        lambda s: bool(s.num_experts),
        lambda s, i: (
            f"{engine_input(s, i)} does not support MoE: the auxiliary losses are scaled as if every CP rank held "
            "seq/cp tokens; drop --num-experts"
        ),
    ),
    _on_engine(
        "cp-engine-mtp",
        lambda s: bool(s.mtp_num_layers),
        lambda s, i: (
            f"{engine_input(s, i)} does not support multi-token prediction (it shifts tokens across Megatron's zigzag "
            "split): drop --mtp-num-layers"
        ),
    ),
    _on_engine(
        "cp-engine-mla",
        lambda s: s.multi_latent_attention,
        lambda s, i: f"{engine_input(s, i)} does not support MLA: drop --multi-latent-attention",
    ),
    _on_engine(
        "cp-engine-positions",
        lambda s: s.position_embedding not in (None,) + POSITION_EMBEDDINGS,
        lambda s, i: (
            f"{engine_input(s, i)} computes positions per sequence for --position-embedding-type "
            f"{' | '.join(POSITION_EMBEDDINGS)}; got {s.position_embedding}"
        ),
    ),
    _on_engine(
        "cp-engine-dropout",
        lambda s: float(s.attention_dropout or 0.0) != 0.0,
        lambda s, i: f"{engine_input(s, i)}: megatron-slim's core attention has no dropout: set --attention-dropout 0",
    ),
    _on_engine(
        "cp-engine-documents",
        lambda s: s.reset_position_ids != s.reset_attention_mask,
        lambda s, i: (
            f"{engine_input(s, i)} attends within the documents it reads from position-id resets: pass "
            "--reset-position-ids and --reset-attention-mask together (or neither: each row is then one sequence)"
        ),
    ),
]
