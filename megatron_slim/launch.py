"""Run a Megatron-LM training script with megatron-slim hooked in, without editing it.

    python -m megatron_slim.launch pretrain_gpt.py <Megatron-LM flags> [--use-slimpipe ...]

torchrun works the same way: ``torchrun ... -m megatron_slim.launch pretrain_gpt.py ...``.
``pretrain_gpt.py --help`` through the launcher lists megatron-slim's flags beside Megatron's
(``--use-slimpipe``, ``--cp-engine``, ``--dynmo-profile``, ``--dynmo-freeze``,
``--dynmo-exit-threshold``, ``--dynmo-mod-capacity``, ``--dynmo-prune``, ...).
"""

from __future__ import annotations

import os
import runpy
import sys

USAGE = (
    "usage: python -m megatron_slim.launch SCRIPT.py [script flags...]\n"
    "  Runs a Megatron-LM training script (pretrain_gpt.py) with megatron-slim hooked in, without\n"
    "  editing it: megatron-slim's flags join Megatron's parser and are checked at start-up.\n"
    "  e.g. torchrun --nproc_per_node 8 -m megatron_slim.launch pretrain_gpt.py <Megatron flags> "
    "--use-slimpipe --slimpipe-num-slices 8\n"
    "  megatron-slim's flags (SlimPipe, CP engines, --dynmo-profile, --dynmo-freeze, --dynmo-exit-threshold, "
    "--dynmo-mod-capacity, --dynmo-prune), beside Megatron's: "
    "python -m megatron_slim.launch pretrain_gpt.py --help"
)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        try:
            print(USAGE, flush=True)
        except BrokenPipeError:  # `... --help | head`: the reader left; say nothing more
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(0)
    if not argv or not argv[0].endswith(".py"):
        raise SystemExit(USAGE)
    script = os.path.abspath(argv[0])
    if not os.path.isfile(script):
        raise SystemExit(f"megatron_slim.launch: {argv[0]}: no such script")
    sys.argv = [script, *argv[1:]]
    sys.path.insert(0, os.path.dirname(script))
    from megatron_slim.megatron.hooks import prepare_launch
    from megatron_slim.plan.schema import ConfigError

    prepare_launch()
    from megatron_slim.runtime.nccl_rules import install_if_asked

    install_if_asked()  # MEGATRON_SLIM_NCCL_RULES=1: match messages as NCCL would (runtime/nccl_rules)
    try:
        runpy.run_path(script, run_name="__main__")
    except ConfigError as exc:  # a flag combination megatron-slim cannot run: say what to change
        print(f"megatron_slim.launch: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
