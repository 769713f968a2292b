"""What ``megatron-slim train`` refuses before any work, and the CP domain it plans for; no torch.

Kept apart from ``loop`` and ``cp`` (which need torch) so that the start-up rule tests of the
pure ``plan`` tier can call ``train``'s own entry point.
"""

from __future__ import annotations

from megatron_slim.plan.cp.costs import CPCosts
from megatron_slim.plan.cp.engines import check_supported
from megatron_slim.plan.cp.topology import CPTopology
from megatron_slim.plan.recipe import Recipe
from megatron_slim.plan.schema import fail
from megatron_slim.plan.startup import TRAIN, check
from megatron_slim.plan.startup.from_recipe import train_settings


def check_trainable(recipe: Recipe) -> None:
    """Reject, before any work, what ``megatron-slim train`` cannot run (``plan.startup.rules``)."""
    check(train_settings(recipe), TRAIN)
    check_cp_trainable(recipe)


def check_cp_trainable(recipe: Recipe) -> None:
    """Reject, before any work, a CP engine that cannot run on this model and topology (the other
    rules are ``plan.startup.rules``'s, which ``check_trainable`` applies first). Packed windows run no
    engine (``Recipe.query_out_cp``)."""
    if recipe.parallel.cp == 1 or recipe.query_out_cp:
        return
    topo, costs = cp_topology(recipe)
    check_supported(recipe.cp.engine, topo, costs)


def cp_topology(recipe: Recipe) -> tuple[CPTopology, CPCosts]:
    """The CP domain (nodes x ranks from ``hardware.gpus_per_node / parallel.tp``) and unit costs."""
    p, hw = recipe.parallel, recipe.hardware_profile
    span = p.cp * p.tp
    if p.dp * p.pp > 1 and hw.gpus_per_node % span and span % hw.gpus_per_node:
        raise fail(
            "parallel.cp",
            p.cp,
            f"a size whose CP group (cp*tp={span} GPUs) divides or is a multiple of "
            f"hardware.gpus_per_node={hw.gpus_per_node}",
            "CP groups would straddle node boundaries",
        )
    return CPTopology.from_hardware(hw, p.cp, p.tp), CPCosts.from_recipe(recipe)
