"""The start-up rules: every combination of settings megatron-slim refuses before any work, once.

Each ``Rule`` names the callers it binds (``LAUNCHER``: Megatron-LM's flags inside
``validate_args``; ``TRAIN``: ``megatron-slim train`` on a recipe; ``MEGATRON_ARGS``: a recipe
turned into flags), says when the settings break it and builds the message through the caller's
``Inputs``, so a rule two callers share reads the same to both, each in its own input names.
``check`` raises the first broken rule's message as a ``ConfigError``. The tables, checked in this
order: ``rules_train``, ``rules_recompute``, ``rules_cp``, ``rules_packing``, ``rules_slimpipe``. Imports no torch.
"""

from __future__ import annotations

from typing import Optional

from megatron_slim.plan.schema import ConfigError
from megatron_slim.plan.startup.rule import Rule as Rule
from megatron_slim.plan.startup.rules_cp import CP_ENGINE_RULES as CP_ENGINE_RULES
from megatron_slim.plan.startup.rules_packing import PACKING_RULES as PACKING_RULES
from megatron_slim.plan.startup.rules_recompute import RECOMPUTE_RULES as RECOMPUTE_RULES
from megatron_slim.plan.startup.rules_slimpipe import SLIMPIPE_RULES as SLIMPIPE_RULES
from megatron_slim.plan.startup.rules_train import TRAIN_RULES as TRAIN_RULES
from megatron_slim.plan.startup.settings import INPUTS, Settings

RULES: list[Rule] = TRAIN_RULES + RECOMPUTE_RULES + CP_ENGINE_RULES + PACKING_RULES + SLIMPIPE_RULES


def broken_rule(settings: Settings, caller: str, rules: Optional[list[Rule]] = None) -> Optional[Rule]:
    """The first of ``rules`` (all by default) that binds ``caller`` and that ``settings`` break."""
    return next((r for r in (RULES if rules is None else rules) if caller in r.callers and r.broken(settings)), None)


def check(settings: Settings, caller: str, rules: Optional[list[Rule]] = None) -> None:
    """Raise ``ConfigError`` with the first broken rule's message, in ``caller``'s input names."""
    rule = broken_rule(settings, caller, rules)
    if rule is not None:
        raise ConfigError(rule.message(settings, INPUTS[caller]))
