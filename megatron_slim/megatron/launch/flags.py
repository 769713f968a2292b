"""Megatron-LM command-line flags: the ones a recipe stands for, and megatron-slim's own.

``recipe_to_megatron_args`` derives ``pretrain_gpt.py`` flags from a recipe (never duplicated by
hand in scripts); ``add_arguments`` registers megatron-slim's flags on Megatron's parser (pass it
as ``extra_args_provider``). Importing this module imports no megatron and no torch.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from megatron_slim.megatron.launch.args import settings_from_megatron_args
from megatron_slim.megatron.launch.cp_checks import check_engine_fits
from megatron_slim.megatron.launch.dynmo_flags import check_dynmo_args, dynmo_to_megatron_args
from megatron_slim.megatron.launch.package_checks import check_installed_packages
from megatron_slim.megatron.launch.recompute_flags import recompute_flags, refuse_what_megatron_cannot_recompute
from megatron_slim.megatron.launch.registered_flags import (  # noqa: F401  (re-exported)
    ATTENTION_BACKENDS,
    CP_ENGINES,
    SLICE_POLICIES,
    add_arguments,
)
from megatron_slim.plan.recipe import MAX_SEED, MEGATRON_CP_ENGINE, ModelConfig, Recipe, TrainConfig
from megatron_slim.plan.schema import ConfigError, fail
from megatron_slim.plan.startup import LAUNCHER, MEGATRON_ARGS, check
from megatron_slim.plan.startup.from_recipe import megatron_args_settings


def _data_flags(data) -> list:
    out = ["--data-path", *data.path] if data.path else []
    if data.tokenizer:
        where = Path(data.tokenizer).expanduser()
        # Megatron's HuggingFaceTokenizer loads a directory (AutoTokenizer.from_pretrained)
        out += [
            "--tokenizer-type",
            "HuggingFaceTokenizer",
            "--tokenizer-model",
            str(where.parent if where.name == "tokenizer.json" else where),
        ]
    return out


def recipe_to_megatron_args(recipe: Recipe) -> list[str]:
    """The ``pretrain_gpt.py`` flags a recipe stands for; of the data, only ``data.path`` (as
    ``--data-path``) and ``data.tokenizer`` (as Megatron's ``HuggingFaceTokenizer``), output paths never."""
    _refuse_what_megatron_cannot_run(recipe)
    out = _model_flags(recipe.model) + _parallel_flags(recipe) + _train_flags(recipe.train)
    out += _data_flags(recipe.data) + _schedule_flags(recipe) + dynmo_to_megatron_args(recipe.dynmo)
    return [str(x) for x in out]


def _refuse_what_megatron_cannot_run(recipe: Recipe) -> None:
    t = recipe.train
    if t.warmup_iters and t.warmup_iters >= t.iters:
        # Megatron's OptimizerParamScheduler asserts warmup < decay steps (train iterations) at start-up
        raise ConfigError(
            f"train.warmup_iters: got {t.warmup_iters} with train.iters={t.iters}; Megatron-LM needs "
            f"fewer warmup than training iterations; allowed: an integer in [0, {t.iters})"
        )
    if t.seed == 0:
        # Megatron-LM's _set_random_seed raises "Seed (0) should be a positive integer" at start-up
        raise ConfigError(
            f"train.seed: got 0; Megatron-LM needs a positive seed; allowed: an integer in [1, {MAX_SEED}]"
        )
    if t.skip_nonfinite_steps:
        raise ConfigError(
            "train.skip_nonfinite_steps: got true; Megatron-LM cannot skip a step whose loss or "
            "gradient norm is nan/inf in fp32 or bf16 (its --check-for-nan-in-loss-and-grad stops "
            "training, as megatron-slim train does by default); allowed: false"
        )
    refuse_what_megatron_cannot_recompute(t)
    check(megatron_args_settings(recipe), MEGATRON_ARGS)


def _model_flags(m: ModelConfig) -> list:
    out = [
        "--num-layers",
        m.num_layers,
        "--hidden-size",
        m.hidden_size,
        "--ffn-hidden-size",
        m.ffn_hidden_size,
        "--num-attention-heads",
        m.num_attention_heads,
        "--seq-length",
        m.seq_length,
        "--max-position-embeddings",
        m.seq_length,
        "--position-embedding-type",
        "rope",
        "--rotary-base",
        _number(m.rotary_base),
        "--normalization",
        "RMSNorm",
        "--norm-epsilon",
        _number(m.norm_epsilon),
        "--swiglu",
        "--disable-bias-linear",
        "--attention-dropout",
        0,
        "--hidden-dropout",
        0,
        "--vocab-size",
        m.vocab_size,
    ]
    if m.num_query_groups != m.num_attention_heads:
        out += ["--group-query-attention", "--num-query-groups", m.num_query_groups]
    if m.untie_embeddings_and_output_weights:
        out += ["--untie-embeddings-and-output-weights"]
    return out


def _parallel_flags(recipe: Recipe) -> list:
    m, p = recipe.model, recipe.parallel
    if p.layers_per_stage and len(set(p.layers_per_stage)) > 1:
        raise fail(
            "parallel.layers_per_stage",
            list(p.layers_per_stage),
            "[] or an even split for Megatron-LM launches (uneven splits run under `megatron-slim train`)",
        )
    out: list = [
        "--tensor-model-parallel-size",
        p.tp,
        "--pipeline-model-parallel-size",
        p.pp,
        "--context-parallel-size",
        p.cp,
    ]
    if p.vpp > 1:
        out += ["--num-layers-per-virtual-pipeline-stage", m.num_layers // (p.pp * p.vpp)]
    if p.sequence_parallel:
        out += ["--sequence-parallel"]
    return out


def _train_flags(t: TrainConfig) -> list:
    out: list = [
        "--micro-batch-size",
        t.micro_batch_size,
        "--global-batch-size",
        t.global_batch_size,
        "--train-iters",
        t.iters,
        "--lr",
        _number(t.lr),
        "--min-lr",
        _number(t.min_lr),
        "--lr-decay-style",
        "cosine",
        "--lr-warmup-iters",
        t.warmup_iters,
        "--weight-decay",
        _number(t.weight_decay),
        "--clip-grad",
        _number(t.clip_grad),
        "--seed",
        t.seed,
        "--log-interval",
        t.log_interval,
    ]
    if t.precision == "bf16":
        out += ["--bf16"]
    if t.distributed_optimizer:
        out += ["--use-distributed-optimizer"]
    out += recompute_flags(t)
    # Megatron requires --save-interval whenever --save is given, and --eval-interval always
    # (0.16-0.19 fail inside the loop otherwise); a recipe's 0 means "once, at the end".
    out += [
        "--save-interval",
        t.save_interval or t.iters,
        "--eval-interval",
        t.eval_interval or t.iters,
        "--eval-iters",
        t.eval_iters,
    ]
    # Megatron's data loader would build a [b, 1, s, s] mask per microbatch (16 GiB at 64K tokens);
    # causal attention needs none (its kernels mask by position) and megatron-slim's engines read
    # documents from position-id resets.
    out += ["--no-create-attention-mask-in-dataloader"]
    return out


def _schedule_flags(recipe: Recipe) -> list:
    s, p = recipe.schedule, recipe.parallel
    out: list = []
    if s.kind == "slimpipe":
        out += [
            "--use-slimpipe",
            "--slimpipe-num-slices",
            s.num_slices,
            "--slimpipe-slice-policy",
            s.slice_policy,
            "--slimpipe-hardware",
            recipe.hardware,
        ] + (["--slimpipe-vocab-parallel"] if s.vocab_parallel else [])
        if recipe.train.offload_ratio:
            out += ["--slimpipe-offload-ratio", _number(recipe.train.offload_ratio)]
    if p.cp > 1 and recipe.cp.engine != MEGATRON_CP_ENGINE and (s.kind != "slimpipe" or recipe.cp.engine != "ring"):
        # megatron-slim's engines plan each pack of documents: positions and masks reset at each one
        # (under SlimPipe, ring stands for SlimPipe's own zigzag query-out: no engine flag; megatron
        # is Megatron-LM's own CP: --context-parallel-size alone, its default --cp-comm-type p2p)
        out += ["--cp-engine", recipe.cp.engine, "--reset-position-ids", "--reset-attention-mask"]
        out += ["--slimpipe-hardware", recipe.hardware] if s.kind != "slimpipe" else []
        out += ["--cp-remap"] if recipe.cp.remap else []
    return out


def _number(x: float) -> str:
    return repr(float(x)) if not float(x).is_integer() or abs(x) >= 1e16 else str(int(x))


def check_megatron_args(args: argparse.Namespace) -> None:
    """Reject flag combinations megatron-slim cannot run, saying what to change. Runs at start-up,
    right after Megatron's own ``validate_args`` (which settles defaults such as
    ``overlap_p2p_comm``), before any model is built. The rules are ``plan.startup.rules``'s,
    shared with ``megatron-slim train``.

    ``--overlap-p2p-communication`` (on by default for interleaved schedules) configures
    megatron-core's ``P2PCommunicator``, which SlimPipe does not use: its own sends and receives are
    asynchronous point-to-point operations ordered per link, so the flag is accepted and has no
    effect under ``--use-slimpipe``."""
    settings = settings_from_megatron_args(args)
    check(settings, LAUNCHER)
    check_dynmo_args(args)
    check_installed_packages(args)
    if settings.cp_engine_runs or settings.cp_engine_slices:
        check_engine_fits(args, settings.cp_engine)
