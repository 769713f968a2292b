"""megatron-slim's own flags on Megatron-LM's parser (``add_arguments``, Megatron's
``extra_args_provider``). Importing this module imports no megatron and no torch."""

from __future__ import annotations

import argparse

from megatron_slim.megatron.launch.dynmo_flags import add_dynmo_arguments
from megatron_slim.plan.recipe import MEGATRON_CP_ENGINE, CPEngine, SlicePolicy
from megatron_slim.plan.startup.rules_packing import PACKING_METHODS

SLICE_POLICIES: tuple[str, ...] = SlicePolicy.__args__  # type: ignore[attr-defined]
# te: Megatron-LM's own context parallelism, the flags' name for a recipe's cp.engine=megatron
CP_ENGINES: tuple[str, ...] = ("te",) + tuple(e for e in CPEngine.__args__ if e != MEGATRON_CP_ENGINE)  # type: ignore[attr-defined]
ATTENTION_BACKENDS = ("auto", "flash", "te", "sdpa", "reference")


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register megatron-slim's flags (use as Megatron's ``extra_args_provider``). Idempotent: a
    parser that has them already is returned unchanged (Megatron 0.18+ parses through nested
    helpers that may each add the provider)."""
    if "--use-slimpipe" in parser._option_string_actions:
        return parser
    g = parser.add_argument_group("megatron-slim")
    g.add_argument(
        "--use-slimpipe",
        action="store_true",
        help="run the SlimPipe slice-level pipeline schedule (K/V cache across slices)",
    )
    g.add_argument("--slimpipe-num-slices", type=int, default=1, help="slices per microbatch (default 1: no slicing)")
    g.add_argument(
        "--slimpipe-slice-policy",
        choices=SLICE_POLICIES,
        default="uniform",
        help=(
            "uniform: equal slices; balanced: equal forward+backward work under the causal mask; exchange: "
            "uniform slices plus attention context exchange between pipeline ranks: blocks of K/V moved so the "
            "ranks of each schedule slot end together, the plan megatron-slim simulate prices and train runs "
            "(any tensor parallel size; context parallelism as SlimPipe's query-out CP, no --cp-engine; full, "
            "selective or no recomputation; no --slimpipe-packing or --slimpipe-vocab-parallel; "
            "docs/context-exchange.md)"
        ),
    )
    g.add_argument(
        "--slimpipe-vocab-parallel",
        action="store_true",
        help=(
            "run the word embedding, output layer and loss on every pipeline rank, each on a part of the "
            "vocabulary (docs/vocab-parallel.md); needs --use-slimpipe, fp32 parameters, "
            "--tensor-model-parallel-size 1, --context-parallel-size 1 and no --slimpipe-packing; any "
            "virtual pipeline size (megatron-slim train runs more)"
        ),
    )
    g.add_argument(
        "--slimpipe-packing",
        choices=PACKING_METHODS,
        default="none",
        help=(
            "none (default): Megatron's dataset windows; else train on windows the method packs from the corpus "
            "documents, global-batch/dp per DP rank (docs/packing.md, Launcher); needs --use-slimpipe, "
            "--calculate-per-token-loss, --micro-batch-size 1, no virtual pipeline stages; any tp and cp (TP rank 0 "
            "hands each microbatch's documents to the other TP ranks, and with more than 2 stages the first stage "
            "to the middle ones)"
        ),
    )
    _add_slimpipe_offload(g)
    _add_slimpipe_cost_and_cp(g)
    add_dynmo_arguments(parser)
    return parser


def _add_slimpipe_offload(g) -> None:
    """SlimPipe's per-slice activation offload (``train.offload_ratio``): Megatron-LM has no such flag."""
    g.add_argument(
        "--slimpipe-offload-ratio",
        type=float,
        default=0.0,
        help=(
            "share in [0, 1] of each slice's decoder-layer activations held in host memory from its forward to its "
            "backward (default 0: none; the first round(R * L) of the L layers per model chunk that keep their "
            "activations, so not under --recompute-method uniform; train.offload_ratio, docs/recompute.md); "
            "needs --use-slimpipe"
        ),
    )


def _add_slimpipe_cost_and_cp(g) -> None:
    """The cost model's inputs and the context-parallel and attention-backend choices."""
    g.add_argument(
        "--slimpipe-hardware",
        default="h100",
        help="hardware profile the balanced policy's cost model uses (megatron_slim/configs/hardware)",
    )
    g.add_argument(
        "--slimpipe-calibration", default=None, help="measured kernel rates for the balanced policy's cost model"
    )
    g.add_argument(
        "--cp-engine",
        choices=CP_ENGINES,
        default="te",
        help=(
            "context-parallel attention: te = Megatron's own (default; a recipe's cp.engine=megatron); the "
            "others are megatron-slim engines "
            "(with --pipeline-model-parallel-size > 1: Megatron's 1F1B, any pp and tp, no virtual stages, no "
            "recomputation; with --use-slimpipe: zeppelin, ring or ulysses plan each window from the "
            "first stage's lengths and every slice follows the plan, any pp and tp, no virtual stages, no "
            "--sequence-parallel at tp > 1; docs/cp-pipeline.md)"
        ),
    )
    g.add_argument(
        "--cp-remap",
        action="store_true",
        help="with --cp-engine zeppelin: token-balanced layout for the MLP (remap layer)",
    )
    g.add_argument(
        "--megatron-slim-attention-backend",
        choices=ATTENTION_BACKENDS,
        default="auto",
        help="attention kernels for megatron-slim's core attention (auto: flash > te > sdpa)",
    )
