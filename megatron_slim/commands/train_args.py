"""``megatron-slim train``'s own flags: outputs, checkpoints, the rank watchdog, metrics and profiling."""

from __future__ import annotations

import argparse

from megatron_slim.commands.arg_types import non_negative_float, positive_int


def add_train_flags(train: argparse.ArgumentParser) -> None:
    train.add_argument(
        "--json", metavar="PATH", help="write losses, tokens/s and per-stage memory as JSON ('-': stdout)"
    )
    train.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        help="save checkpoints here (every train.save_interval iterations and at the end; "
        "torch.distributed.checkpoint, checksummed) and resume from the latest intact one, "
        "also at another parallel.pp/vpp/dp",
    )
    train.add_argument("--no-resume", action="store_true", help="start from scratch even if DIR has a checkpoint")
    train.add_argument(
        "--exit-interval",
        type=positive_int,
        metavar="N",
        help="stop after iteration N with a checkpoint, as an interrupted run would",
    )
    train.add_argument(
        "--rank-timeout",
        type=non_negative_float,
        default=300.0,
        metavar="SECONDS",
        help="stop every rank when one stops responding this long, naming it and its iteration "
        "(a stopped or frozen process; default 300, 0: off; ranks this command spawns)",
    )
    add_observability_args(train)


def add_observability_args(train: argparse.ArgumentParser) -> None:
    group = train.add_argument_group("metrics and profiling (written by the ranks; checked before any work)")
    group.add_argument(
        "--tensorboard-dir",
        metavar="DIR",
        help="log Megatron-LM's TensorBoard tags every iteration (lm loss, learning-rate, grad-norm, "
        "batch-size, iteration-time, throughput; also tokens-per-second and "
        "mem-peak-{activation,kv}-bytes) from the reporting rank; needs the tensorboard "
        "package (pip install 'megatron-slim[metrics]')",
    )
    group.add_argument(
        "--wandb-project", metavar="NAME", help="also log the same values to this W&B project (needs the wandb package)"
    )
    group.add_argument("--wandb-exp-name", metavar="NAME", help="the W&B run name (with --wandb-project)")
    group.add_argument(
        "--wandb-save-dir",
        metavar="DIR",
        help="W&B's local files (with --wandb-project; default: wandb's own, ./wandb)",
    )
    group.add_argument(
        "--profile",
        metavar="DIR",
        help="write a torch profiler trace of one iteration per rank to "
        "DIR/rank_<rank>.trace.json, actions named as in the simulator (F3.2, 1B0.7, "
        "SEND_F3.2); `megatron-slim overlay --measured DIR` compares it with the simulation",
    )
    group.add_argument(
        "--profile-iteration",
        type=int,
        metavar="N",
        help="the iteration --profile traces (1-based; default: the run's last)",
    )
