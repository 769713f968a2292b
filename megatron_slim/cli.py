"""``megatron-slim``: plan, simulate and run long-context training.

Subcommands parse here and run in ``megatron_slim/commands/``. A bad recipe, override or flag
fails before any work with a message naming the field, the value and what is allowed.
"""

from __future__ import annotations

import argparse
import sys

from megatron_slim.commands.arg_types import positive_int, refuse_repeated_overrides
from megatron_slim.commands.simulate_modes import add_mode_args
from megatron_slim.commands.train_args import add_train_flags
from megatron_slim.commands.train_dynmo import add_dynmo_args
from megatron_slim.plan.schema import ConfigError


def _add_recipe_args(p: argparse.ArgumentParser, required: bool = True, default: str | None = None) -> None:
    p.add_argument(
        "--recipe",
        required=required,
        default=default,
        help="shipped recipe name (see `megatron-slim recipes`; files in megatron_slim/configs/, "
        "e.g. llama2-70b-512k) or a path to a recipe YAML" + (f" (default: {default})" if default else ""),
    )
    p.add_argument(
        "--set",
        nargs="+",
        action="extend",
        default=[],
        metavar="KEY=VALUE",
        help="override recipe keys, e.g. --set parallel.pp=8 schedule.num_slices=16",
    )


class _EpilogAsWritten(argparse.HelpFormatter):
    """Wraps the description as usual; keeps an epilog's own line breaks (it is a small table)."""

    def add_text(self, text):
        if text and "\n" in text:
            self._add_item(lambda t: t + "\n", [text])
        else:
            super().add_text(text)


def build_parser() -> argparse.ArgumentParser:
    from megatron_slim import __version__

    parser = argparse.ArgumentParser(prog="megatron-slim", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"megatron-slim {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add_command in (_add_simulate, _add_plan, _add_train, _add_overlay, _add_megatron_args, _add_recipes):
        add_command(sub)
    return parser


def _add_simulate(sub: argparse._SubParsersAction) -> None:
    sim = sub.add_parser(
        "simulate",
        help="simulate a recipe's pipeline schedule: time, bubble, MFU, memory",
        description="Simulate one iteration of a recipe under the cost model.",
    )
    _add_recipe_args(sim)
    sim.add_argument(
        "--compare",
        metavar="KINDS",
        help="comma-separated schedules to simulate side by side, e.g. 1f1b,interleaved,slimpipe",
    )
    sim.add_argument("--json", metavar="PATH", help="write results as JSON to PATH ('-' for stdout)")
    sim.add_argument("--trace", metavar="PATH", help="write a Chrome trace (open in ui.perfetto.dev)")
    sim.add_argument("--plot", metavar="PATH", help="write a PNG of timelines and memory")
    sim.add_argument(
        "--calibration",
        metavar="FILE",
        help="measured kernel rates replacing the hardware profile's efficiencies (format: docs/calibration.md)",
    )
    add_mode_args(sim)
    sim.set_defaults(run="megatron_slim.commands.simulate")


def _add_plan(sub: argparse._SubParsersAction) -> None:
    plan = sub.add_parser(
        "plan",
        help="search tp/cp/pp/vpp/dp, schedule, slices and recompute for the fastest fit (SlimPipe vs Megatron)",
        description="Autotune a recipe's model, sequence length and global batch on --gpus GPUs of its "
        "hardware profile: the fastest configuration that fits memory under the cost model, for "
        "SlimPipe (uniform, balanced or context-exchange slices) and for the best Megatron-LM baseline "
        "(1f1b or interleaved, any recompute), side by "
        "side with the MFU ratio. The recipe's own parallel, schedule and recompute settings are "
        "replaced (they must still pass the recipe's checks after --set); micro-batch size, precision "
        "and the optimizer are kept. Only configurations megatron-args and Megatron-LM's launcher accept "
        "are chosen (SlimPipe's per-slice offload as --slimpipe-offload-ratio; no SlimPipe recompute on a "
        "CP engine's plans).",
    )
    _add_recipe_args(plan)
    plan.add_argument(
        "--gpus", type=positive_int, metavar="N", help="GPUs to plan for (default: the recipe's tp*pp*cp*dp)"
    )
    plan.add_argument("--json", metavar="PATH", help="write both choices and the speedup as JSON ('-' for stdout)")
    plan.add_argument(
        "--calibration",
        metavar="FILE",
        help="measured kernel rates pricing both families, replacing the hardware profile's efficiencies "
        "(format: docs/calibration.md)",
    )
    from megatron_slim.plan.tune.search import DEFAULT_MAX_SIMULATIONS

    plan.add_argument(
        "--max-simulations",
        type=positive_int,
        default=DEFAULT_MAX_SIMULATIONS,
        metavar="K",
        help="at most K exact simulations per family, in the order of the closed-form estimate (a "
        "context-exchange candidate counts as the 3 its group plan runs); the "
        f"search stops sooner once no candidate left can beat the best (default: {DEFAULT_MAX_SIMULATIONS})",
    )
    plan.set_defaults(run="megatron_slim.commands.plan")


def _add_train(sub: argparse._SubParsersAction) -> None:
    train = sub.add_parser(
        "train",
        help="train a recipe on local CPU ranks (default: tiny-cpu on 4 ranks)",
        formatter_class=_EpilogAsWritten,
        description="Run a real training job on megatron-core model chunks with the recipe's "
        "pipeline schedule, on gloo CPU ranks. Each microbatch is a window of "
        "model.seq_length tokens of the corpus with causal attention over the "
        "window; with parallel.cp > 1 the recipe's cp.engine runs (any but megatron, "
        "Megatron-LM's own CP, which needs Transformer Engine: launch it with megatron-args; 1f1b or "
        "interleaved, any parallel.pp, one slice per microbatch; every pipeline "
        "stage plans each window), each window is a pack of the documents between "
        "end-of-document tokens and attention stays inside each document; "
        "schedule.kind=slimpipe with num_slices > 1 and cp.engine = zeppelin | "
        "ring | ulysses plans each window once and runs every slice on that plan "
        "(query-out attention over the K/V cache, docs/cp-pipeline.md). With "
        "data.packing = slimpack | megatron | bfd, each iteration packs the next "
        "documents (cut into samples of at most seq_length) of about "
        "global_batch_size*seq_length tokens into windows by that method, attention "
        "staying inside each document (docs/packing.md); data.packing=none "
        "(default) is the plain windows.",
        epilog="""where the ranks come from:
  megatron-slim train ...
      spawns the recipe's tp*pp*cp*dp gloo ranks on this machine. They never
      outlive it: SIGTERM or Ctrl-C stops them all and exits non-zero (143/130);
      killed outright, its ranks die with it.
  torchrun --nproc_per_node N -m megatron_slim train ...
  torchrun --nproc_per_node N $(which megatron-slim) train ...
      each process is one rank of the torchrun job (detected from RANK,
      WORLD_SIZE, MASTER_ADDR/PORT, TORCHELASTIC_RUN_ID); WORLD_SIZE must equal
      tp*pp*cp*dp. Local rank 0 prepares the corpus cache and the others then
      read it; the last pipeline stage's first rank prints the summary and
      writes --json. The same recipe and seed give the same losses as a
      spawned run.""",
    )
    _add_recipe_args(train, required=False, default="tiny-cpu")
    add_train_flags(train)
    add_dynmo_args(train)
    train.set_defaults(run="megatron_slim.commands.train")


def _add_overlay(sub: argparse._SubParsersAction) -> None:
    overlay = sub.add_parser(
        "overlay",
        help="lay a profiled train iteration beside its simulation (PNG, table)",
        description="Compare the per-rank timelines of an iteration traced by `megatron-slim "
        "train --profile DIR` with the simulation of the same recipe and "
        "schedule (on the recipe's hardware profile, e.g. cpu): busy time per "
        "pipeline rank, both timelines from zero in one PNG.",
    )
    overlay.add_argument(
        "--measured",
        nargs="+",
        required=True,
        metavar="PATH",
        help="the --profile directory of a train run, or its rank_*.trace.json files",
    )
    _add_recipe_args(overlay, required=False, default="tiny-cpu")
    overlay.add_argument(
        "--calibration", metavar="FILE", help="measured kernel rates for the simulation (format: docs/calibration.md)"
    )
    overlay.add_argument("--plot", metavar="PATH", help="write a PNG: measured and simulated timelines, busy time")
    overlay.add_argument("--json", metavar="PATH", help="write the comparison as JSON to PATH ('-' for stdout)")
    overlay.set_defaults(run="megatron_slim.commands.overlay")


def _add_megatron_args(sub: argparse._SubParsersAction) -> None:
    margs = sub.add_parser(
        "megatron-args",
        help="print the Megatron-LM pretrain_gpt.py flags a recipe stands for",
        description="Print the pretrain_gpt.py flags of a recipe (data and output paths "
        "excepted), for `python -m megatron_slim.launch pretrain_gpt.py ...`.",
    )
    _add_recipe_args(margs)
    margs.add_argument(
        "--format",
        choices=("shell", "lines"),
        default="shell",
        help="one shell-quoted line (default) or one flag per line with its values",
    )
    margs.add_argument("--nodes", action="store_true", help="print only the number of nodes the recipe needs")
    margs.add_argument("--gpus-per-node", action="store_true", help="print only the GPUs used per node")
    margs.set_defaults(run="megatron_slim.commands.megatron_args")


def _add_recipes(sub: argparse._SubParsersAction) -> None:
    recipes = sub.add_parser("recipes", help="list shipped recipes and hardware profiles")
    recipes.add_argument("--names", action="store_true", help="print only the recipe names, one per line")
    recipes.set_defaults(run="megatron_slim.commands.recipes")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    refuse_repeated_overrides(parser, getattr(args, "set", None) or [])
    import importlib

    command = importlib.import_module(args.run)
    try:
        return int(command.main(args) or 0)
    except ConfigError as exc:
        print(f"megatron-slim {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM/SIGINT turned into spawn.Interrupted
        import signal

        signum = getattr(exc, "signum", signal.SIGINT)
        ranks = "; its rank processes were stopped" if hasattr(exc, "signum") else ""
        print(f"megatron-slim {args.command}: interrupted by {signal.Signals(signum).name}{ranks}", file=sys.stderr)
        return 128 + signum
    except BrokenPipeError:  # `megatron-slim ... | head`: the reader left; say nothing more
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
