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
        "packing-tp-cp-megatron-core",
        (LAUNCHER,),
        lambda s: s.packing != "none" and (s.tp > 1 or s.cp > 1) and _newer_than_checked(s),
        lambda s, i: (
            f"--slimpipe-packing {s.packing} with --tensor-model-parallel-size {s.tp} and --context-parallel-size "
            f"{s.cp} under megatron-core {_version(s)}: packed windows under tensor or context parallelism match "
            "Megatron-LM's own runs on megatron-core 0.16 and are not yet correct on 0.17 and newer; allowed: "
            "both 1 there, or megatron-core 0.16"
        ),
    ),
]
