"""``Settings`` views of a recipe: as ``megatron-slim train`` runs it, and as the Megatron-LM flags
``megatron-args`` writes for it stand for it."""

from __future__ import annotations

from typing import Any

from megatron_slim.plan.recipe import MEGATRON_CP_ENGINE, Recipe
from megatron_slim.plan.startup.settings import NO_CP_ENGINE, Settings


def _common(recipe: Recipe) -> dict[str, Any]:
    m, p, s, t = recipe.model, recipe.parallel, recipe.schedule, recipe.train
    return dict(
        cp=p.cp,
        tp=p.tp,
        pp=p.pp,
        vpp=p.vpp,
        micro_batch_size=t.micro_batch_size,
        sequence_parallel=p.sequence_parallel,
        num_slices=s.num_slices,
        slice_policy=s.slice_policy,
        vocab_parallel=s.vocab_parallel,
        seq_length=m.seq_length,
        recompute=None if t.recompute == "none" else t.recompute,
        recompute_modules=t.recompute_plan.modules,
        recompute_method=t.recompute_plan.method if t.recompute == "full" else None,
        precision=t.precision,
        eval_iters=t.eval_iters,
        offload_ratio=t.offload_ratio,
    )


def train_settings(recipe: Recipe) -> Settings:
    """``megatron-slim train`` runs ``cp.engine`` whenever ``parallel.cp > 1``, except for packed
    windows (``Recipe.query_out_cp``: SlimPipe's query-out CP attention, no engine): a slimpipe recipe
    with one slice runs whole packs under the engine, so only several slices count as SlimPipe slicing.
    ``cp.engine=megatron`` is kept as named: train cannot run it, and its rule says so."""
    p, s = recipe.parallel, recipe.schedule
    engine_runs = p.cp > 1 and not recipe.query_out_cp
    named = engine_runs or recipe.exchange_cp  # exchange's query-out CP is the one cp.engine=ring names
    return Settings(
        **_common(recipe),
        cp_engine=recipe.cp.engine if named else NO_CP_ENGINE,
        cp_remap=recipe.cp.remap and engine_runs,
        slimpipe=s.kind == "slimpipe" and s.num_slices > 1,
    )


def megatron_args_settings(recipe: Recipe) -> Settings:
    """What ``recipe_to_megatron_args``'s flags stand for: ``--cp-engine`` (and ``--cp-remap``) with
    ``parallel.cp > 1``; ``cp.engine=megatron`` is Megatron-LM's own CP (no ``--cp-engine``); under
    SlimPipe ``cp.engine=ring`` stands for SlimPipe's own zigzag query-out CP (no ``--cp-engine``),
    any other engine plans the windows the slices follow."""
    p, s = recipe.parallel, recipe.schedule
    slimpipe = s.kind == "slimpipe"
    engine_runs = p.cp > 1 and not slimpipe and recipe.cp.engine != MEGATRON_CP_ENGINE
    engine_slices = p.cp > 1 and slimpipe and recipe.cp.engine != "ring"
    return Settings(
        **_common(recipe),
        cp_engine=recipe.cp.engine if engine_runs or engine_slices else NO_CP_ENGINE,
        cp_remap=recipe.cp.remap and (engine_runs or engine_slices),
        slimpipe=slimpipe,
        packing=recipe.data.packing,
    )
