"""Start-up rules of SlimPipe runs (``--use-slimpipe``, ``schedule.num_slices``)."""

from __future__ import annotations

from typing import Callable

from megatron_slim.plan.cost.slicing import is_aligned, max_slices, slice_alignment, splits_uniformly
from megatron_slim.plan.recipe_sections import SLICED_CP_ENGINES
from megatron_slim.plan.startup.rule import Rule, cp_comm_type_set, engine_input
from megatron_slim.plan.startup.settings import (
    LAUNCHER,
    MEGATRON_ARGS,
    NO_CP_ENGINE,
    TRAIN,
    Inputs,
    Settings,
)


def _on_slimpipe(name: str, broken: Callable[[Settings], bool], message: str) -> Rule:
    """A launcher rule for ``--use-slimpipe`` runs with a fixed message."""
    return Rule(name, (LAUNCHER,), lambda s: s.slimpipe and broken(s), lambda s, i: message)


# a recipe's name for SlimPipe's zigzag query-out CP under exchange (launcher: no --cp-engine)
EXCHANGE_CP_ENGINE = "ring"


def _engine_slices_run(s: Settings) -> bool:
    """The launcher runs SlimPipe slices on a CP engine's plans: every rank plans each window from the
    lengths the first stage's TP rank 0 read (``megatron/slimpipe/engine_slices.py``)."""
    return (
        s.cp_engine in SLICED_CP_ENGINES
        and not s.cp_remap
        and s.packing == "none"
        and s.vpp == 1
        and not (s.tp > 1 and s.sequence_parallel)
    )


def _engine_slices_got(s: Settings, i: Inputs) -> str:
    got = [i.setting("tp", s.tp), i.setting("vpp", s.vpp)]
    got += [i.setting("sequence_parallel", True)] if s.sequence_parallel else []
    got += [i.setting("cp_remap", True)] if s.cp_remap else []
    got += [i.setting("packing", s.packing)] if s.packing != "none" else []
    return f"{engine_input(s, i)} with {i.setting('slimpipe', True)}, {', '.join(got)}"


def _vocab_exchange_refused_by_launcher(s: Settings) -> bool:
    return not s.slimpipe or s.tp > 1 or s.cp > 1 or s.precision != "fp32" or s.packing != "none"


def _packing(s: Settings, i: Inputs) -> str:
    """The launcher's ``--slimpipe-packing`` (a recipe's packing is no Megatron-LM flag)."""
    return f", --slimpipe-packing {s.packing}" if i.flags else ""


def _packing_off(i: Inputs) -> str:
    return ", --slimpipe-packing none" if i.flags else ""


def _unit(s: Settings) -> int:
    return slice_alignment(s.cp, s.tp, s.sequence_parallel)


SLIMPIPE_RULES = [
    Rule(
        "slice-policy-exchange",
        (LAUNCHER, MEGATRON_ARGS),
        lambda s: s.slimpipe and s.slice_policy == "exchange" and s.vocab_parallel,
        lambda s, i: (
            f"{i.setting('slice_policy', s.slice_policy)} with {i.setting('vocab_parallel', True)}: under "
            "Megatron-LM's launcher context exchange runs (with any vpp, tensor parallelism, SlimPipe's query-out "
            "context parallelism or activation recomputation) without the vocabulary exchange; allowed: "
            f"{i.unset('vocab_parallel', 'false')}, or {i.setting('slice_policy', 'uniform')} or balanced"
        ),
    ),
    Rule(
        "slice-policy-exchange-cp-engine",
        (LAUNCHER, MEGATRON_ARGS),
        lambda s: s.slice_policy == "exchange" and s.cp_engine_slices,
        lambda s, i: (
            f"{i.setting('slice_policy', s.slice_policy)} with {i.setting('cp', s.cp)} and "
            f"{engine_input(s, i)}: context exchange runs under SlimPipe's query-out context parallelism over zigzag "
            f"shards of plain causal windows ({i.unset('cp_engine', EXCHANGE_CP_ENGINE)}), not under an engine's "
            f"planned windows; allowed: {i.unset('cp_engine', EXCHANGE_CP_ENGINE)}, {i.setting('cp', 1)}, or "
            f"{i.setting('slice_policy', 'uniform')} or balanced"
        ),
    ),
    _on_slimpipe(
        "slice-policy-exchange-packing",
        lambda s: s.slice_policy == "exchange" and s.packing != "none",
        "--slimpipe-slice-policy exchange: context exchange runs on unpacked windows only; allowed: "
        "--slimpipe-packing none, or --slimpipe-slice-policy uniform or balanced",
    ),
    Rule(
        "slice-policy-exchange-train",
        (TRAIN,),
        lambda s: s.slimpipe and s.slice_policy == "exchange" and s.vocab_parallel,
        lambda s, i: (
            f"{i.setting('slice_policy', s.slice_policy)} with {i.setting('vocab_parallel', s.vocab_parallel)}: "
            "context exchange runs (with any vpp, tensor or context parallelism or activation recomputation) "
            f"without the vocabulary exchange; allowed: {i.name('vocab_parallel')}=false, or "
            f"{i.name('slice_policy')}=uniform or balanced"
        ),
    ),
    Rule(
        "slice-policy-exchange-cp",
        (TRAIN,),
        lambda s: (
            s.slimpipe
            and s.slice_policy == "exchange"
            and s.cp > 1
            and s.cp_engine not in (EXCHANGE_CP_ENGINE, NO_CP_ENGINE)
        ),
        lambda s, i: (
            f"{i.setting('slice_policy', s.slice_policy)} with {i.setting('cp', s.cp)} and "
            f"{i.setting('cp_engine', s.cp_engine)}: context exchange runs under SlimPipe's query-out context "
            f"parallelism over zigzag shards of plain causal windows, which {i.name('cp_engine')}="
            f"{EXCHANGE_CP_ENGINE} names, not under an engine's planned windows; allowed: "
            f"{i.name('cp_engine')}={EXCHANGE_CP_ENGINE}, or {i.name('cp')}=1, or "
            f"{i.name('slice_policy')}=uniform or balanced"
        ),
    ),
    Rule(
        "vocab-parallel-megatron",
        (LAUNCHER, MEGATRON_ARGS),
        lambda s: s.vocab_parallel and _vocab_exchange_refused_by_launcher(s),
        lambda s, i: (
            f"{i.setting('vocab_parallel', True)} with {i.setting('tp', s.tp)}, {i.setting('cp', s.cp)}, "
            f"{s.precision} parameters{_packing(s, i)}: under Megatron-LM's launcher the vocabulary exchange "
            "runs in the SlimPipe schedule (any number of model chunks per pipeline rank), on fp32 parameters, "
            "without tensor or context parallelism (megatron-slim train runs more); "
            f"allowed: {i.setting('slimpipe', True)}, {i.setting('tp', 1)}, {i.setting('cp', 1)}, "
            f"{i.unset('precision', 'fp32')}{_packing_off(i)}, or {i.unset('vocab_parallel', 'false')}"
        ),
    ),
    Rule(
        "vocab-parallel-train",
        (TRAIN,),
        lambda s: (
            s.vocab_parallel
            and (
                (s.cp > 1 and (not s.cp_engine_runs or s.vpp > 1 or s.tp > 1))
                or (s.tp > 1 and (s.vpp > 1 or s.sequence_parallel))
            )
        ),
        lambda s, i: (
            f"{i.setting('vocab_parallel', True)} with {i.setting('tp', s.tp)}, {i.setting('cp', s.cp)}, "
            f"{i.setting('vpp', s.vpp)}, {i.setting('sequence_parallel', s.sequence_parallel)}: the pipeline's "
            "vocabulary exchange runs with context parallelism only under a CP engine, with one model chunk per "
            "rank and without tensor parallelism, and with tensor parallelism on one model chunk per rank and "
            "whole (not sequence-parallel) hidden states; "
            f"allowed: {i.name('cp')}=1, or {i.name('vpp')}=1 and {i.name('tp')}=1; with {i.name('tp')} > 1 "
            f"{i.name('vpp')}=1 and {i.name('sequence_parallel')}=false; or {i.unset('vocab_parallel', 'false')}"
        ),
    ),
    Rule(
        "slices-need-slimpipe",
        (LAUNCHER,),
        lambda s: not s.slimpipe and s.num_slices != 1,
        lambda s, i: "--slimpipe-num-slices: needs --use-slimpipe",
    ),
    Rule(
        "slice-count",
        (LAUNCHER,),
        lambda s: s.slimpipe and s.num_slices < 1,
        lambda s, i: f"--slimpipe-num-slices: got {s.num_slices}; allowed: an integer >= 1",
    ),
    _on_slimpipe(
        "slimpipe-hierarchical-cp",
        lambda s: bool(s.hierarchical_cp_sizes),
        "--use-slimpipe runs context parallelism as query-out attention on the flat CP group: drop "
        "--hierarchical-context-parallel-sizes",
    ),
    _on_slimpipe(
        "slimpipe-comm-type",
        lambda s: cp_comm_type_set(s.cp_comm_type),
        "--use-slimpipe runs context parallelism as query-out attention (all-gather Q, all-to-all of "
        "partial outputs): drop --cp-comm-type",
    ),
    _on_slimpipe(
        "slimpipe-hybrid-cp",
        lambda s: s.hybrid_cp,
        "--use-slimpipe does not support hybrid context parallelism: drop --hybrid-context-parallel",
    ),
    _on_slimpipe(
        "slimpipe-partial-checkpoints",
        lambda s: s.partial_checkpoints is not None,
        "--use-slimpipe does not support partial activation checkpointing: drop "
        "--num-microbatches-with-partial-activation-checkpoints",
    ),
    _on_slimpipe(
        "slimpipe-document-masks",
        lambda s: s.reset_attention_mask and not s.cp_engine_slices,
        "--use-slimpipe takes packed documents from batches with a document_lengths key (docs/packing.md, "
        "Runtime); through pretrain_gpt.py the middle pipeline stages and the other TP ranks never see "
        "the --reset-attention-mask mask: drop --reset-attention-mask",
    ),
    Rule(
        "slimpipe-recompute",
        (LAUNCHER, MEGATRON_ARGS),
        lambda s: s.slimpipe and s.recompute is not None and s.cp_engine_slices,
        lambda s, i: (
            f"{i.name('recompute')}: got {s.recompute!r} with {i.setting('slimpipe', True)}, "
            f"{i.setting('cp', s.cp)} and {engine_input(s, i)}; SlimPipe's recomputation (a recomputed slice "
            "reads its cached K/V prefix) is checked under SlimPipe's own zigzag query-out context parallelism "
            f"only, not on a CP engine's plans; allowed: {i.unset('cp_engine', EXCHANGE_CP_ENGINE)}, "
            f"{i.unset('recompute', 'none')}, {i.setting('cp', 1)}, or Megatron's own schedule "
            f"({i.name('megatron_schedule')})"
        ),
    ),
    _on_slimpipe(
        "slimpipe-moe", lambda s: bool(s.num_experts), "--use-slimpipe does not support MoE yet: drop --num-experts"
    ),
    _on_slimpipe(
        "slimpipe-mla",
        lambda s: s.multi_latent_attention,
        "--use-slimpipe does not support MLA: drop --multi-latent-attention",
    ),
    _on_slimpipe(
        "slimpipe-cuda-graph-impl",
        lambda s: s.cuda_graph_impl not in (None, "none"),
        "--use-slimpipe cannot run under CUDA graphs: set --cuda-graph-impl none",
    ),
    _on_slimpipe(
        "slimpipe-cuda-graphs",
        lambda s: s.enable_cuda_graph,
        "--use-slimpipe cannot run under CUDA graphs: drop --enable-cuda-graph",
    ),
    _on_slimpipe(
        "slimpipe-mtp", lambda s: bool(s.mtp_num_layers), "--use-slimpipe does not support multi-token prediction"
    ),
    _on_slimpipe(
        "slimpipe-packing",
        lambda s: s.sequence_packing,
        "--use-slimpipe slices windows of --seq-length tokens, a fixed number per iteration; Megatron-LM's "
        "runtime packing scheduler (--sequence-packing / --sequence-packing-scheduler) hands out THD "
        "microbatches of varying length and count: drop it. Packed windows run through --slimpipe-packing, "
        "and THD batches of --seq-length tokens (--sft, --dataloader-inter-document-masking) run as they are",
    ),
    _on_slimpipe(
        "slimpipe-positions",
        lambda s: s.position_embedding not in (None, "rope", "none"),
        "--use-slimpipe needs --position-embedding-type rope (or none)",
    ),
    Rule(
        "slimpipe-with-cp-engine",
        (LAUNCHER, MEGATRON_ARGS),
        lambda s: s.cp_engine_slices and not _engine_slices_run(s),
        lambda s, i: (
            f"{_engine_slices_got(s, i)}: SlimPipe slices follow a CP engine's plan of each window for "
            f"{i.name('cp_engine')} {' | '.join(SLICED_CP_ENGINES)} with {i.name('vpp')}=1, no "
            f"{i.name('sequence_parallel')} when {i.name('tp')} > 1 (a plan's row counts need not divide by tp), "
            f"no {i.name('cp_remap')} and no {i.name('packing')}; allowed: those, or "
            f"{i.unset('cp_engine', NO_CP_ENGINE if i.flags else 'ring')} (SlimPipe's own zigzag query-out CP), "
            f"or {i.name('megatron_schedule')}"
        ),
    ),
    Rule(
        "slimpipe-cp-engine-documents",
        (LAUNCHER,),
        lambda s: s.cp_engine_slices and s.reset_position_ids != s.reset_attention_mask,
        lambda s, i: (
            f"{engine_input(s, i)} with --use-slimpipe plans the documents it reads from position-id resets: pass "
            "--reset-position-ids and --reset-attention-mask together (or neither: each row is then one sequence)"
        ),
    ),
    Rule(
        "slice-alignment",
        (LAUNCHER,),
        lambda s: s.slimpipe and not is_aligned(s.seq_length, _unit(s)),
        lambda s, i: (
            f"--seq-length {s.seq_length}: SlimPipe slice boundaries are multiples of {_unit(s)} tokens (2*cp zigzag "
            f"chunks, times tp under --sequence-parallel); allowed: a multiple of {_unit(s)}"
        ),
    ),
    Rule(
        "uniform-slices",
        (LAUNCHER,),
        lambda s: (
            s.slimpipe and s.slice_policy != "balanced" and not splits_uniformly(s.seq_length, s.num_slices, _unit(s))
        ),
        lambda s, i: (
            f"--slimpipe-num-slices {s.num_slices}: --seq-length {s.seq_length} does not split into "
            f"{s.num_slices} equal slices that are multiples of {_unit(s)} tokens; allowed: a divisor of "
            f"{max_slices(s.seq_length, _unit(s))} (or --slimpipe-slice-policy balanced)"
        ),
    ),
    Rule(
        "slices-fit",
        (LAUNCHER,),
        lambda s: s.slimpipe and s.num_slices > max_slices(s.seq_length, _unit(s)),
        lambda s, i: (
            f"--slimpipe-num-slices {s.num_slices}: at most {max_slices(s.seq_length, _unit(s))} "
            f"slices of --seq-length {s.seq_length}"
        ),
    ),
]
