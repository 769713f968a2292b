"""Start-up rules, written once for every caller: ``rules.RULES`` evaluated on a neutral
``settings.Settings`` view that the launcher builds from Megatron-LM's flags and ``train`` /
``megatron-args`` from a recipe. Imports no torch and no megatron."""

from megatron_slim.plan.cost.slicing import slice_alignment
from megatron_slim.plan.startup.rules import RULES, Rule, broken_rule, check
from megatron_slim.plan.startup.settings import INPUTS, LAUNCHER, MEGATRON_ARGS, TRAIN, Inputs, Settings

__all__ = [
    "INPUTS",
    "LAUNCHER",
    "MEGATRON_ARGS",
    "RULES",
    "TRAIN",
    "Inputs",
    "Rule",
    "Settings",
    "broken_rule",
    "check",
    "slice_alignment",
]
