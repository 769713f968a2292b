"""Which candidates ``megatron-slim plan`` may choose: those the product launches as planned.

A plan priced on a GPU profile is launched on GPUs, and the one GPU path is the recipe turned into
Megatron-LM flags (``megatron-args``), which Megatron-LM's launcher checks again inside
``validate_args``. So a candidate is runnable when the start-up rules of both callers,
``MEGATRON_ARGS`` and ``LAUNCHER`` (``plan/startup/rules.py``), pass on what those flags stand for:

- SlimPipe: ``--use-slimpipe``; ``cp.engine=ring`` is SlimPipe's own zigzag query-out CP. Per-slice
  activation offload runs, as megatron-slim's ``--slimpipe-offload-ratio`` (with any ``parallel.cp``;
  not beside full uniform recomputation, which leaves no layer's activations to move), and so does
  recomputation on SlimPipe's query-out CP; recomputation on a CP engine's plans is refused.
- Megatron baseline: ``cp.engine=megatron`` (``plan/tune/space.py``), Megatron-LM's own context
  parallelism, the attention the cost model prices the baseline with; its flags carry no
  ``--cp-engine``.

``megatron-slim train`` is not the reference: it is the CPU training loop, and its device rules
(fp32 only, no sequence parallelism) refuse every bf16 GPU recipe. The rules read a few fields, so
each distinct ``Settings`` is checked once.
"""

from __future__ import annotations

from collections import Counter
from typing import Optional

from megatron_slim.plan.recipe import Recipe
from megatron_slim.plan.startup import LAUNCHER, MEGATRON_ARGS, Settings, broken_rule
from megatron_slim.plan.startup.from_recipe import megatron_args_settings

LAUNCH_CALLERS = (MEGATRON_ARGS, LAUNCHER)


def launch_settings(recipe: Recipe) -> Settings:
    """What the launched flags stand for: the recipe as ``megatron-args`` emits it."""
    return megatron_args_settings(recipe)


class Runnable:
    """The start-up rule each recipe breaks under ``callers`` (``None``: it runs), one check per
    distinct ``Settings``; ``refused`` counts the refusals by rule name."""

    def __init__(self, callers: tuple[str, ...] = LAUNCH_CALLERS) -> None:
        self.callers = callers
        self.verdicts: dict[Settings, Optional[str]] = {}
        self.refused: Counter[str] = Counter()

    def refusal(self, recipe: Recipe) -> Optional[str]:
        settings = launch_settings(recipe)
        if settings not in self.verdicts:
            rules = (broken_rule(settings, caller) for caller in self.callers)
            rule = next((r for r in rules if r is not None), None)
            self.verdicts[settings] = None if rule is None else rule.name
        name = self.verdicts[settings]
        if name is not None:
            self.refused[name] += 1
        return name
