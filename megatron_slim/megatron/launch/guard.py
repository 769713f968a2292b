"""The launcher's hooks read Megatron-LM's parsed args; a script whose loop never parses them (a
Megatron-Bridge recipe: ``megatron.bridge.training.pretrain`` takes a ``ConfigContainer``) would
leave every hook a silent no-op while the user's megatron-slim flags are ignored. ``guarded``
turns that into an error the first time a hook asks for the args."""

from __future__ import annotations

import argparse
from typing import Any, Callable, Optional, Sequence

from megatron_slim.megatron.launch.flags import add_arguments
from megatron_slim.plan.schema import ConfigError


def megatron_slim_flags(argv: Sequence[str]) -> list[str]:
    """The megatron-slim flags (``--use-slimpipe``, ``--cp-engine``, ...) on a command line."""
    ours = add_arguments(argparse.ArgumentParser(add_help=False))._option_string_actions
    return [arg.split("=", 1)[0] for arg in argv if arg.split("=", 1)[0] in ours]


def guarded(get_args: Callable[[], Optional[Any]], argv: Sequence[str]) -> Callable[[], Optional[Any]]:
    """``get_args`` that raises when megatron-slim flags are on ``argv`` but a hook runs before (or
    without) Megatron-LM parsing any args: the script's loop would bypass them."""
    requested = megatron_slim_flags(argv)

    def args_or_refuse() -> Optional[Any]:
        args = get_args()
        if args is None and requested:
            raise ConfigError(
                f"{', '.join(requested)}: this script builds its model without Megatron-LM's argument parser "
                "(megatron.training.get_args() is unset), so its training loop would ignore these flags; that is "
                "how Megatron-Bridge runs (megatron.bridge.training.pretrain reads a ConfigContainer). For Bridge, "
                "drop the flags and the launcher and call megatron_slim.megatron.bridge.install(config, "
                "num_slices=...) before pretrain() (docs/megatron-bridge.md); allowed here: a script that parses "
                "Megatron-LM's arguments, such as pretrain_gpt.py"
            )
        return args

    return args_or_refuse
