"""Start-up checks for ``--cp-engine`` (megatron-slim's CP engines) on a parsed Megatron-LM namespace.

The rules themselves live in ``plan.startup.rules_cp`` (``CP_ENGINE_RULES``, shared with
``megatron-slim train``); here they are applied to Megatron-LM's flags, followed by the head
counts each engine needs on the hardware profile's topology. ``check_cp_args(args)`` does nothing
unless a megatron-slim engine runs (``--cp-engine`` not ``te``, ``--context-parallel-size > 1``, no
``--use-slimpipe``). Each rejection says why and what to change. Imports no torch.
"""

from __future__ import annotations

import argparse

from megatron_slim.megatron.launch.args import recipe_from_megatron_args, settings_from_megatron_args
from megatron_slim.plan.startup import LAUNCHER, check
from megatron_slim.plan.startup.rules_cp import CP_ENGINE_RULES


def check_cp_args(args: argparse.Namespace) -> None:
    settings = settings_from_megatron_args(args)
    if not settings.cp_engine_runs:
        return
    check(settings, LAUNCHER, CP_ENGINE_RULES)
    check_engine_fits(args, settings.cp_engine)


def check_engine_fits(args: argparse.Namespace, engine: str) -> None:
    """Head counts the engine needs (ulysses: heads per TP rank divisible by cp; a2a+p2p: by the CP
    ranks of a node), on the topology of the hardware profile."""
    from megatron_slim.plan.cp.costs import CPCosts
    from megatron_slim.plan.cp.engines import check_supported
    from megatron_slim.plan.cp.topology import CPTopology

    recipe = recipe_from_megatron_args(args)
    p = recipe.parallel
    check_supported(engine, CPTopology.from_hardware(recipe.hardware_profile, p.cp, p.tp), CPCosts.from_recipe(recipe))
