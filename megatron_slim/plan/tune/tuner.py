"""``tune``: the fastest configuration that fits, for SlimPipe and for the best Megatron baseline."""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Optional

from megatron_slim.plan.cost.calibration import Calibration
from megatron_slim.plan.progress import Progress
from megatron_slim.plan.recipe import Recipe
from megatron_slim.plan.schema import ConfigError
from megatron_slim.plan.tune.search import DEFAULT_MAX_SIMULATIONS, FamilyResult, search
from megatron_slim.plan.tune.space import FAMILIES, candidates, layouts, usable_gpu_counts

_GIB = 2**30


@dataclass(frozen=True)
class TuneResult:
    recipe: Recipe
    gpus: int
    families: dict[str, FamilyResult]

    @property
    def speedup(self) -> Optional[float]:
        """SlimPipe's MFU over the Megatron baseline's (None when either has no fit)."""
        s, m = self.families["slimpipe"].best, self.families["megatron"].best
        return s.mfu / m.mfu if s and m and m.mfu > 0 else None


def _nearest_valid(recipe: Recipe, gpus: int) -> list[int]:
    usable = usable_gpu_counts(recipe)
    at = bisect.bisect_left(usable, gpus)
    below = usable[at - 1] if at > 0 else None
    above = usable[at] if at < len(usable) else None
    return [g for g in (below, above) if g is not None]


def check_gpus(recipe: Recipe, gpus: int) -> None:
    if gpus < 1:
        raise ConfigError(f"--gpus {gpus}: allowed: an integer >= 1")
    if gpus in set(usable_gpu_counts(recipe)) and layouts(recipe, gpus):
        return
    m, t = recipe.model, recipe.train
    near = ", ".join(str(g) for g in _nearest_valid(recipe, gpus)) or "none found"
    raise ConfigError(
        f"--gpus {gpus}: no layout tp*cp*pp*dp={gpus} fits the recipe (allowed: a count that splits into "
        f"tp <= 8 dividing model.num_attention_heads={m.num_attention_heads} and "
        f"model.num_query_groups={m.num_query_groups}, cp with 2*cp dividing model.seq_length={m.seq_length}, "
        f"pp dividing model.num_layers={m.num_layers} and dp dividing "
        f"train.global_batch_size/train.micro_batch_size={t.global_batch_size // t.micro_batch_size}; "
        f"nearest: {near})"
    )


def nothing_fits(name: str, result: FamilyResult) -> str:
    cap = f"{result.cap_bytes / _GIB:.1f} GiB"
    if result.smallest is None:
        refused = ", ".join(f"{n} ({k})" for n, k in sorted(result.refused.items()))
        why = f" that the start-up rules accept (refused by: {refused})" if refused else ""
        return f"{name}: no candidate in the search space{why} for this recipe and GPU count"
    s = result.smallest
    kind = "simulated" if s.simulated else "lower bound"
    return (
        f"{name}: nothing fits in {cap} (the profile's usable HBM): smallest peak found "
        f"{s.peak_bytes / _GIB:.1f} GiB ({kind}) with {s.label}"
    )


def tune(
    recipe: Recipe,
    gpus: int,
    max_simulations: Optional[int] = DEFAULT_MAX_SIMULATIONS,
    calibration: Optional[Calibration] = None,
    progress: Optional[Progress] = None,
) -> TuneResult:
    """Search both families; raises ``ConfigError`` for a GPU count no layout uses, or when neither fits.
    ``calibration``: measured kernel rates both families are priced with; ``progress`` hears each
    family's search as ``("<family>: <phase>", done, total)``."""
    check_gpus(recipe, gpus)

    def family_progress(name: str) -> Optional[Progress]:
        if progress is None:
            return None
        outer = progress
        return lambda phase, done, total: outer(f"{name}: {phase}", done, total)

    families = {
        name: search(
            recipe,
            candidates(recipe, gpus, kinds),
            max_simulations,
            calibration,
            progress=family_progress(name),
        )
        for name, kinds in FAMILIES.items()
    }
    if all(r.best is None for r in families.values()):
        raise ConfigError("; ".join(nothing_fits(name, r) for name, r in families.items()))
    return TuneResult(recipe, gpus, families)
