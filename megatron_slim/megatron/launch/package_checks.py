"""Start-up checks on what the installed packages must provide for the flags a job was given.

A missing optional package that Megatron-LM imports lazily fails late, or worse: without
``psutil``, megatron-core's ``torch_dist`` checkpoint writer (``FileSystemWriterAsync``) cannot run
its writer processes and the job hangs at its first save, hours in. These checks run at start-up,
with megatron-slim's other checks, and name the package to install.
"""

from __future__ import annotations

import argparse
import importlib.util
from typing import Callable, Optional

from megatron_slim.plan.schema import ConfigError

# --ckpt-format values whose writer is megatron-core's FileSystemWriterAsync (it imports psutil)
PSUTIL_FORMATS = ("torch_dist",)


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def check_installed_packages(args: argparse.Namespace, installed: Optional[Callable[[str], bool]] = None) -> None:
    """Refuse a job whose flags need a package that is not installed, naming the flag and the package."""
    installed = installed or _installed
    ckpt_format = getattr(args, "ckpt_format", "torch_dist")
    if getattr(args, "save", None) and ckpt_format in PSUTIL_FORMATS and not installed("psutil"):
        raise ConfigError(
            f"--save {args.save} with --ckpt-format {ckpt_format}: megatron-core's checkpoint writer needs "
            "the psutil package, which is not installed here (without it the job hangs at its first save); "
            "allowed: pip install psutil (the megatron-lm extra installs it), or --ckpt-format torch"
        )
