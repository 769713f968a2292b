"""The note ``--set`` overrides that change a recipe's GPU count get (``megatron-slim simulate``,
``train``, ``megatron-args`` print it)."""

from __future__ import annotations

from typing import Optional

from megatron_slim.plan.files import load_yaml_mapping
from megatron_slim.plan.recipe import Recipe, recipe_path
from megatron_slim.plan.schema import parse_override


def world_size_note(
    name_or_path: str, overrides: Optional[list[str]], recipe: Recipe, unit: str = "GPUs"
) -> Optional[str]:
    """A line saying so when ``--set`` overrides change the GPU count (``tp*pp*cp*dp``) from the
    recipe file's, e.g. ``note: --set parallel.pp=8 changes the job from 64 to 128 GPUs (tp4 pp8 cp1
    dp4)``; None when they do not. Overrides keep every other key as written (``parallel.dp``
    included), so a larger pp means more GPUs, not fewer data-parallel replicas: the note also says
    which ``parallel.dp`` would keep the original count, when one would."""
    if not overrides:
        return None
    path = recipe_path(name_or_path)
    data = load_yaml_mapping(path, f"--recipe {path}")
    section = data.get("parallel")
    section = section if isinstance(section, dict) else {}
    try:
        base = 1
        for key in ("tp", "pp", "cp", "dp"):
            base *= int(section.get(key, 1))
    except (TypeError, ValueError):  # the file's own value is invalid and overridden: nothing to compare with
        return None
    p = recipe.parallel
    if base == p.world_size:
        return None
    sizes = [(o.strip(), parse_override(o)[0]) for o in overrides]
    sizes = [(text, path) for text, path in sizes if path in (["parallel", k] for k in ("tp", "pp", "cp", "dp"))]
    changed = [text for text, _ in sizes]
    note = (
        f"note: --set {' '.join(changed)} changes the job from {base} to {p.world_size} {unit} "
        f"(tp{p.tp} pp{p.pp} cp{p.cp} dp{p.dp})"
    )
    model_parallel = p.tp * p.pp * p.cp
    if base % model_parallel == 0 and not any(path == ["parallel", "dp"] for _, path in sizes):
        dp = base // model_parallel
        if recipe.train.global_batch_size % (recipe.train.micro_batch_size * dp) == 0:
            note += f"; parallel.dp={dp} would keep {base}"
    return note
