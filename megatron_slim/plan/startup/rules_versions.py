"""Launcher paths checked against Megatron-LM's own runs on some megatron-cores only: on the others
they are refused at start-up, naming the version (``CHECKED_BELOW_MEGATRON_CORE``)."""

from __future__ import annotations

from megatron_slim.plan.startup.rule import Rule
from megatron_slim.plan.startup.settings import CHECKED_BELOW_MEGATRON_CORE, LAUNCHER, Settings


def _newer_than_checked(s: Settings) -> bool:
    return s.megatron_core is not None and s.megatron_core >= CHECKED_BELOW_MEGATRON_CORE


def _version(s: Settings) -> str:
    return ".".join(str(v) for v in s.megatron_core or ())


VERSION_RULES = [
    Rule(
        "vocab-parallel-megatron-core",
        (LAUNCHER,),
        lambda s: s.vocab_parallel and _newer_than_checked(s),
        lambda s, i: (
            f"--slimpipe-vocab-parallel under megatron-core {_version(s)}: the launcher's vocabulary exchange "
            "matches Megatron-LM's own runs on megatron-core 0.16 and is not yet correct on 0.17 and newer; "
            "allowed: megatron-core 0.16, or drop --slimpipe-vocab-parallel (megatron-slim train runs it)"
        ),
    ),
]
