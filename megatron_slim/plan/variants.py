"""Turn a recipe into the same run under another pipeline schedule, for side-by-side comparison."""

from __future__ import annotations

import dataclasses
from typing import cast

from megatron_slim.plan.cost.slicing import splits_uniformly
from megatron_slim.plan.recipe import Recipe, ScheduleKind
from megatron_slim.plan.schedule.generators import GENERATORS
from megatron_slim.plan.schema import ConfigError


def _smallest_vpp(recipe: Recipe) -> int:
    per_rank = recipe.model.num_layers // recipe.parallel.pp
    for v in range(2, per_rank + 1):
        if per_rank % v == 0:
            return v
    raise ConfigError(
        f"--compare interleaved: model.num_layers={recipe.model.num_layers} leaves "
        f"{per_rank} layer(s) per pipeline rank, too few for two chunks"
    )


def _default_slices(recipe: Recipe) -> int:
    """The smallest power of two >= pp whose uniform slices fit the alignment, else 1."""
    n = 1
    while n < recipe.parallel.pp:
        n *= 2
    while not splits_uniformly(recipe.model.seq_length, n, recipe.slice_alignment) and n > 1:
        n //= 2
    return n


def schedule_variant(recipe: Recipe, kind: str) -> Recipe:
    """``recipe`` with ``schedule.kind=kind``; vpp and slices adjusted where the kind needs it:
    1f1b uses one chunk and no slices; interleaved keeps the recipe's vpp if > 1, else the
    smallest that divides the layers; slimpipe keeps the recipe's slices if it is a slimpipe
    recipe, else the smallest power of two >= pp."""
    name = kind.strip().lower()
    if name not in GENERATORS:
        raise ConfigError(f"--compare: unknown schedule {name!r} (allowed: {', '.join(GENERATORS)})")
    kind = cast(ScheduleKind, name)
    p, s = recipe.parallel, recipe.schedule
    if kind == "1f1b":
        parallel, schedule = dataclasses.replace(p, vpp=1), dataclasses.replace(s, kind=kind, num_slices=1)
    elif kind == "interleaved":
        vpp = p.vpp if p.vpp > 1 else _smallest_vpp(recipe)
        # virtual chunks take the even split (an uneven one is per pipeline rank, vpp=1)
        parallel = dataclasses.replace(p, vpp=vpp, layers_per_stage=())
        schedule = dataclasses.replace(s, kind=kind, num_slices=1)
    else:
        slices = s.num_slices if s.kind == "slimpipe" else _default_slices(recipe)
        parallel, schedule = p, dataclasses.replace(s, kind=kind, num_slices=slices)
    return dataclasses.replace(recipe, parallel=parallel, schedule=schedule)
