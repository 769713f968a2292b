"""The rules between the ``dynmo:`` models and the rest of a recipe (parallelism, schedule, data)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_slim.plan.schema import fail

if TYPE_CHECKING:
    from megatron_slim.plan.recipe import Recipe


def check_dynmo(recipe: Recipe) -> None:
    """Every rule of the ``dynmo:`` section that needs the rest of the recipe."""
    d = recipe.dynmo
    d.check_model(recipe.model.num_layers, recipe)
    if d.early_exit and (recipe.parallel.sequence_parallel or recipe.cp.remap):
        on = "parallel.sequence_parallel" if recipe.parallel.sequence_parallel else "cp.remap"
        raise fail(
            "dynmo.exit_threshold",
            d.exit_threshold,
            f"0 with {on}=true (exits are chosen per token of a full sequence)",
        )
    check_dynamic_models(recipe)
    if d.profile and recipe.train.recompute != "none":
        raise fail(
            "dynmo.profile",
            True,
            "false with train.recompute != none (a recomputed forward would count as backward)",
        )
    if d.rebalancing and (recipe.parallel.pp < 2 or recipe.parallel.vpp != 1):
        raise fail(
            "dynmo.rebalance",
            d.rebalance,
            f"static with parallel.pp={recipe.parallel.pp}, parallel.vpp={recipe.parallel.vpp} "
            "(moving layers needs pp >= 2 and vpp = 1)",
        )


def check_dynamic_models(recipe: Recipe) -> None:
    d, p = recipe.dynmo, recipe.parallel
    if d.prune_schedule is not None and (p.tp > 1 or p.sequence_parallel):
        raise fail(
            "dynmo.prune",
            d.prune,
            '"" with parallel.tp > 1 or parallel.sequence_parallel (neurons are chosen per whole layer)',
        )
    if d.mixture_of_depths:
        conflicts = {
            "dynmo.exit_threshold > 0": d.early_exit,
            "parallel.tp > 1": p.tp > 1,
            "parallel.cp > 1": p.cp > 1,
            "parallel.sequence_parallel": p.sequence_parallel,
            "schedule.num_slices > 1": recipe.schedule.num_slices > 1,
            "data.packing": recipe.data.packing != "none",
        }
        on = [name for name, value in conflicts.items() if value]
        if on:
            raise fail(
                "dynmo.mod_capacity",
                d.mod_capacity,
                f"0 with {on[0]} (a router picks tokens of one whole, unpacked sequence on one rank)",
            )
    if d.moe:
        conflicts = {
            "dynmo.exit_threshold > 0": d.early_exit,
            "dynmo.prune": d.prune_schedule is not None,
            "dynmo.mod_capacity > 0": d.mixture_of_depths,
            "parallel.tp > 1": p.tp > 1,
            "parallel.cp > 1": p.cp > 1,
            "parallel.sequence_parallel": p.sequence_parallel,
        }
        on = [name for name, value in conflicts.items() if value]
        if on:
            raise fail("dynmo.moe_experts", d.moe_experts, f"0 with {on[0]} (not combined with MoE layers yet)")
