"""The start-up rules: every combination of settings megatron-slim refuses before any work, once.

Each ``Rule`` names the callers it binds (``LAUNCHER``: Megatron-LM's flags inside
``validate_args``; ``TRAIN``: ``megatron-slim train`` on a recipe; ``MEGATRON_ARGS``: a recipe
turned into flags), says when the settings break it and builds the message through the caller's
``Inputs``, so a rule two callers share reads the same to both, each in its own input names.
``check`` raises the first broken rule's message as a ``ConfigError``. Imports no torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from megatron_slim.plan.cost.slicing import is_aligned, max_slices, slice_alignment, splits_uniformly
from megatron_slim.plan.schema import ConfigError, fail
from megatron_slim.plan.startup.settings import INPUTS, LAUNCHER, MEGATRON_ARGS, NO_CP_ENGINE, TRAIN, Inputs, Settings

POSITION_EMBEDDINGS = ("rope", "learned_absolute", "none")


@dataclass(frozen=True)
class Rule:
    name: str
    callers: tuple[str, ...]
    broken: Callable[[Settings], bool]
    message: Callable[[Settings, Inputs], str]


def _cp_comm_type_set(value: Any) -> bool:
    values = value if isinstance(value, (list, tuple)) else [value]
    return any(v not in (None, "p2p") for v in values)


def _engine(s: Settings, i: Inputs) -> str:
    return i.setting("cp_engine", s.cp_engine)


def _on_engine(name: str, broken: Callable[[Settings], bool], message: Callable[[Settings, Inputs], str],
               callers: tuple[str, ...] = (LAUNCHER,)) -> Rule:
    """A rule for runs whose attention is a megatron-slim CP engine."""
    return Rule(name, callers, lambda s: s.cp_engine_runs and broken(s), message)


def _on_slimpipe(name: str, broken: Callable[[Settings], bool], message: str) -> Rule:
    """A launcher rule for ``--use-slimpipe`` runs with a fixed message."""
    return Rule(name, (LAUNCHER,), lambda s: s.slimpipe and broken(s), lambda s, i: message)


def _unit(s: Settings) -> int:
    return slice_alignment(s.cp, s.tp, s.sequence_parallel)


TRAIN_RULES = [
    Rule("cpu-sequence-parallel", (TRAIN,), lambda s: s.sequence_parallel, lambda s, i: (
        "parallel.sequence_parallel: megatron-core's sequence-parallel buffers are CUDA-only; allowed on CPU "
        "ranks: false")),
    Rule("cpu-recompute", (TRAIN,), lambda s: s.recompute is not None, lambda s, i: (
        f"train.recompute: got {s.recompute!r}; the CPU training loop does not recompute activations (the models "
        "here are small; Megatron-LM does, through megatron-args with schedule.kind=1f1b or interleaved); "
        "allowed: none")),
    Rule("cpu-precision", (TRAIN,), lambda s: s.precision != "fp32",
         lambda s, i: "train.precision: CPU ranks train in fp32; allowed: fp32"),
    Rule("train-evaluates", (TRAIN,), lambda s: bool(s.eval_iters), lambda s, i: (
        f"train.eval_iters: got {s.eval_iters}; megatron-slim train does not evaluate (Megatron-LM's loop does, "
        "see megatron-args); allowed here: 0")),
    Rule("train-slices-under-cp", (TRAIN,), lambda s: s.cp > 1 and s.slimpipe, lambda s, i: str(fail(
        "schedule.num_slices", s.num_slices, f"1 with parallel.cp > 1 and cp.engine={s.cp_engine}",
        "SlimPipe slices are not supported with this CP engine" if s.cp_engine != "ring" else
        "megatron-slim train does not wire SlimPipe x CP slices (query-out attention over the whole window, no "
        "document masking) yet; here cp.engine=ring runs whole packs of documents"))),
]

CP_ENGINE_RULES = [
    Rule("cp-engine-needs-cp", (LAUNCHER,), lambda s: s.cp_engine != NO_CP_ENGINE and s.cp == 1, lambda s, i: (
        f"{_engine(s, i)}: needs --context-parallel-size > 1 (or drop --cp-engine)")),
    Rule("remap-needs-zeppelin", (LAUNCHER, TRAIN), lambda s: s.cp_remap and s.cp_engine != "zeppelin",
         lambda s, i: (f"{i.name('cp_remap')}: only with {i.setting('cp_engine', 'zeppelin')} (only Zeppelin has a "
                       f"remapping layer; got {_engine(s, i)})")),
    _on_engine("one-pack-per-microbatch", lambda s: s.micro_batch_size != 1, lambda s, i: (
        f"{_engine(s, i)} plans one pack per microbatch: set {i.setting('micro_batch_size', 1)} "
        "(pack documents instead)"), (LAUNCHER, TRAIN)),
    _on_engine("cp-engine-without-pipeline", lambda s: s.pp > 1, lambda s, i: (
        f"{_engine(s, i)} needs {i.setting('pp', 1)}: the pipeline schedules send fixed [seq/cp] shapes between "
        "stages, and middle stages never see a batch, so they could not follow each microbatch's plan"),
        (LAUNCHER, TRAIN)),
    _on_engine("cp-engine-sequence-parallel", lambda s: s.sequence_parallel and s.tp > 1, lambda s, i: (
        f"{_engine(s, i)} with --sequence-parallel and TP > 1 is not supported: a plan gives CP ranks token "
        "counts that need not divide by TP (and --cp-remap moves whole CP-rank layouts); drop --sequence-parallel")),
    _on_engine("cp-engine-cuda-graphs", lambda s: s.cuda_graphs, lambda s, i: (
        f"{_engine(s, i)} cannot run under CUDA graphs (plans change every microbatch; graph replays bypass the "
        "remap layer's forward): set --cuda-graph-impl none")),
    _on_engine("cp-engine-hybrid-cp", lambda s: s.hybrid_cp, lambda s, i: (
        f"{_engine(s, i)} replaces Megatron's hybrid context parallelism: drop --hybrid-context-parallel")),
    _on_engine("cp-engine-hierarchical-cp", lambda s: bool(s.hierarchical_cp_sizes), lambda s, i: (
        f"{_engine(s, i)} takes its node layout from the hardware profile (--slimpipe-hardware): drop "
        "--hierarchical-context-parallel-sizes")),
    _on_engine("cp-engine-comm-type", lambda s: _cp_comm_type_set(s.cp_comm_type), lambda s, i: (
        f"{_engine(s, i)} chooses the CP communication itself: drop --cp-comm-type")),
    _on_engine("cp-engine-moe", lambda s: bool(s.num_experts), lambda s, i: (
        f"{_engine(s, i)} does not support MoE: the auxiliary losses are scaled as if every CP rank held seq/cp "
        "tokens; drop --num-experts")),
    _on_engine("cp-engine-mtp", lambda s: bool(s.mtp_num_layers), lambda s, i: (
        f"{_engine(s, i)} does not support multi-token prediction (it shifts tokens across Megatron's zigzag "
        "split): drop --mtp-num-layers")),
    _on_engine("cp-engine-mla", lambda s: s.multi_latent_attention, lambda s, i: (
        f"{_engine(s, i)} does not support MLA: drop --multi-latent-attention")),
    _on_engine("cp-engine-positions", lambda s: s.position_embedding not in (None,) + POSITION_EMBEDDINGS,
               lambda s, i: (f"{_engine(s, i)} computes positions per sequence for --position-embedding-type "
                             f"{' | '.join(POSITION_EMBEDDINGS)}; got {s.position_embedding}")),
    _on_engine("cp-engine-dropout", lambda s: float(s.attention_dropout or 0.0) != 0.0, lambda s, i: (
        f"{_engine(s, i)}: megatron-slim's core attention has no dropout: set --attention-dropout 0")),
    _on_engine("cp-engine-documents", lambda s: s.reset_position_ids != s.reset_attention_mask, lambda s, i: (
        f"{_engine(s, i)} attends within the documents it reads from position-id resets: pass --reset-position-ids "
        "and --reset-attention-mask together (or neither: each row is then one sequence)")),
]

SLIMPIPE_RULES = [
    Rule("slices-need-slimpipe", (LAUNCHER,), lambda s: not s.slimpipe and s.num_slices != 1,
         lambda s, i: "--slimpipe-num-slices: needs --use-slimpipe"),
    Rule("slice-count", (LAUNCHER,), lambda s: s.slimpipe and s.num_slices < 1,
         lambda s, i: f"--slimpipe-num-slices: got {s.num_slices}; allowed: an integer >= 1"),
    _on_slimpipe("slimpipe-hierarchical-cp", lambda s: bool(s.hierarchical_cp_sizes),
                 "--use-slimpipe runs context parallelism as query-out attention on the flat CP group: drop "
                 "--hierarchical-context-parallel-sizes"),
    _on_slimpipe("slimpipe-comm-type", lambda s: _cp_comm_type_set(s.cp_comm_type),
                 "--use-slimpipe runs context parallelism as query-out attention (all-gather Q, all-to-all of "
                 "partial outputs): drop --cp-comm-type"),
    _on_slimpipe("slimpipe-hybrid-cp", lambda s: s.hybrid_cp,
                 "--use-slimpipe does not support hybrid context parallelism: drop --hybrid-context-parallel"),
    _on_slimpipe("slimpipe-partial-checkpoints", lambda s: s.partial_checkpoints is not None,
                 "--use-slimpipe does not support partial activation checkpointing: drop "
                 "--num-microbatches-with-partial-activation-checkpoints"),
    _on_slimpipe("slimpipe-document-masks", lambda s: s.reset_attention_mask,
                 "--use-slimpipe attends causally over the whole sequence (no document masking): drop "
                 "--reset-attention-mask"),
    Rule("slimpipe-recompute", (LAUNCHER, MEGATRON_ARGS), lambda s: s.slimpipe and s.recompute is not None,
         lambda s, i: (f"{i.name('recompute')}: got {s.recompute!r} with {i.setting('slimpipe', True)}; SlimPipe keeps "
                       "each slice's K/V in a cache that a recomputed forward would fill again (activation "
                       f"recomputation is not supported with it yet); allowed: {i.unset('recompute', 'none')}, or "
                       f"Megatron's own schedule ({i.name('megatron_schedule')})")),
    _on_slimpipe("slimpipe-moe", lambda s: bool(s.num_experts), "--use-slimpipe does not support MoE yet: drop "
                 "--num-experts"),
    _on_slimpipe("slimpipe-mla", lambda s: s.multi_latent_attention,
                 "--use-slimpipe does not support MLA: drop --multi-latent-attention"),
    _on_slimpipe("slimpipe-cuda-graph-impl", lambda s: s.cuda_graph_impl not in (None, "none"),
                 "--use-slimpipe cannot run under CUDA graphs: set --cuda-graph-impl none"),
    _on_slimpipe("slimpipe-cuda-graphs", lambda s: s.enable_cuda_graph,
                 "--use-slimpipe cannot run under CUDA graphs: drop --enable-cuda-graph"),
    _on_slimpipe("slimpipe-mtp", lambda s: bool(s.mtp_num_layers),
                 "--use-slimpipe does not support multi-token prediction"),
    _on_slimpipe("slimpipe-packing", lambda s: s.sequence_packing,
                 "--use-slimpipe does not support packed (THD) sequences yet"),
    _on_slimpipe("slimpipe-positions", lambda s: s.position_embedding not in (None, "rope", "none"),
                 "--use-slimpipe needs --position-embedding-type rope (or none)"),
    Rule("slimpipe-with-cp-engine", (LAUNCHER,), lambda s: s.slimpipe and s.cp > 1 and s.cp_engine != NO_CP_ENGINE,
         lambda s, i: (f"{_engine(s, i)}: --use-slimpipe brings its own context-parallel attention (query-out over "
                       "the K/V-cached slices): drop --cp-engine and --cp-remap")),
    Rule("slice-alignment", (LAUNCHER,), lambda s: s.slimpipe and not is_aligned(s.seq_length, _unit(s)), lambda s, i: (
        f"--seq-length {s.seq_length}: SlimPipe slice boundaries are multiples of {_unit(s)} tokens (2*cp zigzag "
        f"chunks, times tp under --sequence-parallel); allowed: a multiple of {_unit(s)}")),
    Rule("uniform-slices", (LAUNCHER,), lambda s: (s.slimpipe and s.slice_policy == "uniform"
                                                   and not splits_uniformly(s.seq_length, s.num_slices, _unit(s))),
         lambda s, i: (f"--slimpipe-num-slices {s.num_slices}: --seq-length {s.seq_length} does not split into "
                       f"{s.num_slices} equal slices that are multiples of {_unit(s)} tokens; allowed: a divisor of "
                       f"{max_slices(s.seq_length, _unit(s))} (or --slimpipe-slice-policy balanced)")),
    Rule("slices-fit", (LAUNCHER,), lambda s: s.slimpipe and s.num_slices > max_slices(s.seq_length, _unit(s)),
         lambda s, i: (f"--slimpipe-num-slices {s.num_slices}: at most {max_slices(s.seq_length, _unit(s))} "
                       f"slices of --seq-length {s.seq_length}")),
]
RULES: list[Rule] = TRAIN_RULES + CP_ENGINE_RULES + SLIMPIPE_RULES


def broken_rule(settings: Settings, caller: str, rules: Optional[list[Rule]] = None) -> Optional[Rule]:
    """The first of ``rules`` (all by default) that binds ``caller`` and that ``settings`` break."""
    return next((r for r in (RULES if rules is None else rules)
                 if caller in r.callers and r.broken(settings)), None)


def check(settings: Settings, caller: str, rules: Optional[list[Rule]] = None) -> None:
    """Raise ``ConfigError`` with the first broken rule's message, in ``caller``'s input names."""
    rule = broken_rule(settings, caller, rules)
    if rule is not None:
        raise ConfigError(rule.message(settings, INPUTS[caller]))
