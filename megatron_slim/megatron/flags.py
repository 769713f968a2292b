"""Megatron-LM command-line flags: the ones a recipe stands for, and megatron-slim's own.

``recipe_to_megatron_args`` derives ``pretrain_gpt.py`` flags from a recipe (never duplicated by
hand in scripts); ``add_arguments`` registers megatron-slim's flags on Megatron's parser (pass it
as ``extra_args_provider``). Importing this module imports no megatron and no torch.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from megatron_slim.plan.recipe import MAX_SEED, CPEngine, Recipe, SlicePolicy
from megatron_slim.plan.schema import ConfigError

SLICE_POLICIES: tuple[str, ...] = SlicePolicy.__args__  # type: ignore[attr-defined]
CP_ENGINES: tuple[str, ...] = ("te",) + CPEngine.__args__  # type: ignore[attr-defined]
ATTENTION_BACKENDS = ("auto", "flash", "te", "sdpa", "reference")


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register megatron-slim's flags (use as Megatron's ``extra_args_provider``). Idempotent: a
    parser that has them already is returned unchanged (Megatron 0.18+ parses through nested
    helpers that may each add the provider)."""
    if "--use-slimpipe" in parser._option_string_actions:
        return parser
    g = parser.add_argument_group("megatron-slim")
    g.add_argument("--use-slimpipe", action="store_true",
                   help="run the SlimPipe slice-level pipeline schedule (K/V cache across slices)")
    g.add_argument("--slimpipe-num-slices", type=int, default=1,
                   help="slices per microbatch (default 1: no slicing)")
    g.add_argument("--slimpipe-slice-policy", choices=SLICE_POLICIES, default="uniform",
                   help="uniform: equal slices; balanced: equal forward+backward work under the causal mask")
    g.add_argument("--slimpipe-hardware", default="h100",
                   help="hardware profile the balanced policy's cost model uses "
                        "(megatron_slim/configs/hardware)")
    g.add_argument("--slimpipe-calibration", default=None,
                   help="measured kernel rates for the balanced policy's cost model")
    g.add_argument("--cp-engine", choices=CP_ENGINES, default="te",
                   help="context-parallel attention: te = Megatron's own (default); the others are "
                        "megatron-slim engines")
    g.add_argument("--cp-remap", action="store_true",
                   help="with --cp-engine zeppelin: token-balanced layout for the MLP (remap layer)")
    g.add_argument("--megatron-slim-attention-backend", choices=ATTENTION_BACKENDS, default="auto",
                   help="attention kernels for megatron-slim's core attention (auto: flash > te > sdpa)")
    return parser


def _data_flags(data) -> list:
    out = ["--data-path", *data.path] if data.path else []
    if data.tokenizer:
        where = Path(data.tokenizer).expanduser()
        # Megatron's HuggingFaceTokenizer loads a directory (AutoTokenizer.from_pretrained)
        out += ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                str(where.parent if where.name == "tokenizer.json" else where)]
    return out


def recipe_to_megatron_args(recipe: Recipe) -> list[str]:
    """The ``pretrain_gpt.py`` flags a recipe stands for; of the data, only ``data.path`` (as
    ``--data-path``) and ``data.tokenizer`` (as Megatron's ``HuggingFaceTokenizer``), output paths never."""
    m, p, t, s = recipe.model, recipe.parallel, recipe.train, recipe.schedule
    out = [
        "--num-layers", m.num_layers, "--hidden-size", m.hidden_size,
        "--ffn-hidden-size", m.ffn_hidden_size, "--num-attention-heads", m.num_attention_heads,
        "--seq-length", m.seq_length, "--max-position-embeddings", m.seq_length,
        "--position-embedding-type", "rope", "--rotary-base", _number(m.rotary_base),
        "--normalization", "RMSNorm", "--norm-epsilon", _number(m.norm_epsilon),
        "--swiglu", "--disable-bias-linear", "--attention-dropout", 0, "--hidden-dropout", 0,
        "--vocab-size", m.vocab_size,
    ]
    if m.num_query_groups != m.num_attention_heads:
        out += ["--group-query-attention", "--num-query-groups", m.num_query_groups]
    if m.untie_embeddings_and_output_weights:
        out += ["--untie-embeddings-and-output-weights"]
    out += ["--tensor-model-parallel-size", p.tp, "--pipeline-model-parallel-size", p.pp,
            "--context-parallel-size", p.cp]
    if p.vpp > 1:
        out += ["--num-layers-per-virtual-pipeline-stage", m.num_layers // (p.pp * p.vpp)]
    if p.sequence_parallel:
        out += ["--sequence-parallel"]
    if t.warmup_iters and t.warmup_iters >= t.iters:
        # Megatron's OptimizerParamScheduler asserts warmup < decay steps (train iterations) at start-up
        raise ConfigError(f"train.warmup_iters: got {t.warmup_iters} with train.iters={t.iters}; Megatron-LM needs "
                          f"fewer warmup than training iterations; allowed: an integer in [0, {t.iters})")
    if t.seed == 0:
        # Megatron-LM's _set_random_seed raises "Seed (0) should be a positive integer" at start-up
        raise ConfigError("train.seed: got 0; Megatron-LM needs a positive seed; "
                          f"allowed: an integer in [1, {MAX_SEED}]")
    if t.skip_nonfinite_steps:
        raise ConfigError("train.skip_nonfinite_steps: got true; Megatron-LM cannot skip a step whose loss or "
                          "gradient norm is nan/inf in fp32 or bf16 (its --check-for-nan-in-loss-and-grad stops "
                          "training, as megatron-slim train does by default); allowed: false")
    out += ["--micro-batch-size", t.micro_batch_size, "--global-batch-size", t.global_batch_size,
            "--train-iters", t.iters, "--lr", _number(t.lr), "--min-lr", _number(t.min_lr),
            "--lr-decay-style", "cosine", "--lr-warmup-iters", t.warmup_iters,
            "--weight-decay", _number(t.weight_decay), "--clip-grad", _number(t.clip_grad),
            "--seed", t.seed, "--log-interval", t.log_interval]
    if t.precision == "bf16":
        out += ["--bf16"]
    if t.distributed_optimizer:
        out += ["--use-distributed-optimizer"]
    if t.recompute == "full" and s.kind == "slimpipe":
        raise ConfigError("train.recompute: got 'full' with schedule.kind=slimpipe; SlimPipe keeps each slice's K/V in "
                          "a cache that a recomputed forward would fill again, so the launcher refuses "
                          "--recompute-granularity with --use-slimpipe (allowed: none with slimpipe; full with "
                          "schedule.kind=1f1b or interleaved, Megatron's own schedules)")
    if t.recompute == "full":
        out += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", 1]
    # Megatron requires --save-interval whenever --save is given, and --eval-interval always
    # (0.16-0.19 fail inside the loop otherwise); a recipe's 0 means "once, at the end".
    out += ["--save-interval", t.save_interval or t.iters, "--eval-interval", t.eval_interval or t.iters,
            "--eval-iters", t.eval_iters]
    # Megatron's data loader would build a [b, 1, s, s] mask per microbatch (16 GiB at 64K tokens);
    # causal attention needs none (its kernels mask by position) and megatron-slim's engines read
    # documents from position-id resets.
    out += ["--no-create-attention-mask-in-dataloader"]
    out += _data_flags(recipe.data)
    if s.kind == "slimpipe":
        out += ["--use-slimpipe", "--slimpipe-num-slices", s.num_slices, "--slimpipe-slice-policy",
                s.slice_policy, "--slimpipe-hardware", recipe.hardware]
    if p.cp > 1 and s.kind != "slimpipe":
        # megatron-slim's engines plan each pack of documents: positions and masks reset at each one
        out += ["--cp-engine", recipe.cp.engine, "--reset-position-ids", "--reset-attention-mask",
                "--slimpipe-hardware", recipe.hardware] + (["--cp-remap"] if recipe.cp.remap else [])
    return [str(x) for x in out]


def _number(x: float) -> str:
    return repr(float(x)) if not float(x).is_integer() or abs(x) >= 1e16 else str(int(x))


def check_megatron_args(args: argparse.Namespace) -> None:
    """Reject flag combinations megatron-slim cannot run, saying what to change. Runs at start-up,
    right after Megatron's own ``validate_args`` (which settles defaults such as
    ``overlap_p2p_comm``), before any model is built.

    ``--overlap-p2p-communication`` (on by default for interleaved schedules) configures
    megatron-core's ``P2PCommunicator``, which SlimPipe does not use: its own sends and receives are
    asynchronous point-to-point operations ordered per link, so the flag is accepted and has no
    effect under ``--use-slimpipe``."""
    if args.cp_engine not in ("te",) and getattr(args, "context_parallel_size", 1) == 1:
        raise ConfigError(f"--cp-engine {args.cp_engine}: needs --context-parallel-size > 1 "
                          "(or drop --cp-engine)")
    if args.cp_remap and args.cp_engine != "zeppelin":
        raise ConfigError("--cp-remap: only with --cp-engine zeppelin")
    from megatron_slim.megatron.cp_checks import check_cp_args

    check_cp_args(args)
    if not args.use_slimpipe:
        if args.slimpipe_num_slices != 1:
            raise ConfigError("--slimpipe-num-slices: needs --use-slimpipe")
        return
    n = args.slimpipe_num_slices
    if n < 1:
        raise ConfigError(f"--slimpipe-num-slices: got {n}; allowed: an integer >= 1")
    problems = {
        "hierarchical_context_parallel_sizes": (bool, "--use-slimpipe runs context parallelism as query-out "
                                                "attention on the flat CP group: drop "
                                                "--hierarchical-context-parallel-sizes"),
        "cp_comm_type": (lambda v: any(t not in (None, "p2p") for t in (v if isinstance(v, (list, tuple)) else [v])),
                         "--use-slimpipe runs context parallelism as query-out attention (all-gather Q, "
                         "all-to-all of partial outputs): drop --cp-comm-type"),
        "hybrid_context_parallel": (bool, "--use-slimpipe does not support hybrid context parallelism: "
                                          "drop --hybrid-context-parallel"),
        "num_microbatches_with_partial_activation_checkpoints": (
            lambda v: v is not None, "--use-slimpipe does not support partial activation checkpointing: drop "
                                     "--num-microbatches-with-partial-activation-checkpoints"),
        "reset_attention_mask": (bool, "--use-slimpipe attends causally over the whole sequence (no document "
                                       "masking): drop --reset-attention-mask"),
        "recompute_granularity": (lambda v: v is not None,
                                  "--use-slimpipe keeps each slice's K/V in a cache that a recomputed forward "
                                  "would fill again (activation recomputation is not supported with it yet): drop "
                                  "--recompute-granularity, or use Megatron's own schedule (no --use-slimpipe)"),
        "num_experts": (lambda v: bool(v), "--use-slimpipe does not support MoE yet: drop --num-experts"),
        "multi_latent_attention": (bool, "--use-slimpipe does not support MLA: drop --multi-latent-attention"),
        "cuda_graph_impl": (lambda v: v not in (None, "none"),
                            "--use-slimpipe cannot run under CUDA graphs: set --cuda-graph-impl none"),
        "enable_cuda_graph": (bool, "--use-slimpipe cannot run under CUDA graphs: drop --enable-cuda-graph"),
        "mtp_num_layers": (lambda v: bool(v), "--use-slimpipe does not support multi-token prediction"),
        "sequence_packing": (bool, "--use-slimpipe does not support packed (THD) sequences yet"),
        "position_embedding_type": (lambda v: v not in (None, "rope", "none"),
                                    "--use-slimpipe needs --position-embedding-type rope (or none)"),
    }
    for name, (bad, message) in problems.items():
        if name in vars(args) and bad(getattr(args, name)):
            raise ConfigError(message)
    cp = getattr(args, "context_parallel_size", 1) or 1
    if cp > 1 and args.cp_engine != "te":
        raise ConfigError(f"--cp-engine {args.cp_engine}: --use-slimpipe brings its own context-parallel attention "
                          "(query-out over the K/V-cached slices): drop --cp-engine and --cp-remap")
    seq = args.seq_length
    unit = (2 * cp if cp > 1 else 1) * (
        getattr(args, "tensor_model_parallel_size", 1) if getattr(args, "sequence_parallel", False) else 1)
    if seq % unit:
        raise ConfigError(f"--seq-length {seq}: SlimPipe slice boundaries are multiples of {unit} tokens "
                          "(2*cp zigzag chunks, times tp under --sequence-parallel); allowed: a multiple of "
                          f"{unit}")
    if args.slimpipe_slice_policy == "uniform" and seq % (n * unit):
        raise ConfigError(
            f"--slimpipe-num-slices {n}: --seq-length {seq} does not split into {n} equal slices that are "
            f"multiples of {unit} tokens; allowed: a divisor of {seq // unit} (or --slimpipe-slice-policy balanced)")
    if seq < n * unit:
        raise ConfigError(f"--slimpipe-num-slices {n}: at most {seq // unit} slices of --seq-length {seq}")


def recipe_from_megatron_args(args: argparse.Namespace) -> Recipe:
    """The recipe a parsed Megatron-LM argument namespace stands for (what the cost model needs for
    balanced slices and what the simulator would be given for the same run)."""
    from megatron_slim.plan.recipe import recipe_from_dict

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
                     "sequence_parallel": bool(getattr(args, "sequence_parallel", False))
                     and args.tensor_model_parallel_size > 1},
        "train": {"global_batch_size": args.global_batch_size or args.micro_batch_size * dp,
                  "micro_batch_size": args.micro_batch_size,
                  "precision": "bf16" if getattr(args, "bf16", False) or getattr(args, "fp16", False) else "fp32",
                  "recompute": "full" if getattr(args, "recompute_granularity", None) == "full" else "none"},
        "schedule": {"kind": "slimpipe", "num_slices": args.slimpipe_num_slices,
                     "slice_policy": args.slimpipe_slice_policy},
    }
    return recipe_from_dict(data)
