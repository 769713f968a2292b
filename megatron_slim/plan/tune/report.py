"""What ``megatron-slim plan`` reports: the JSON payload and the rows of its side-by-side table."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from megatron_slim.plan.tune.search import Evaluated, FamilyResult
from megatron_slim.plan.tune.space import describe, settings
from megatron_slim.plan.tune.tuner import TuneResult, nothing_fits

_GIB = 2**30
TITLES = {"slimpipe": "SlimPipe", "megatron": "Megatron baseline"}


def _override_text(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def chosen(run: Evaluated, family: FamilyResult) -> dict[str, Any]:
    """The chosen recipe settings, the figures they reach, and the search that found them."""
    r = run.recipe
    train_keys = ("global_batch_size", "micro_batch_size", *(k for k, _ in run.candidate.recompute))
    return {
        "label": run.label,
        "parallel": dataclasses.asdict(r.parallel),
        "schedule": dataclasses.asdict(r.schedule),
        "train": {k: getattr(r.train, k) for k in train_keys},
        "set": [f"{k}={_override_text(v)}" for k, v in settings(run.candidate).items()],
        "num_microbatches": r.num_microbatches,
        "mfu": run.mfu,
        "iteration_time_s": run.iteration_time_s,
        "bubble_ratio": run.bubble_ratio,
        "peak_memory_bytes": int(run.peak_memory_bytes),
        "search": search_counts(family),
    }


def search_counts(family: FamilyResult) -> dict[str, Any]:
    return {
        "candidates": family.candidates,
        "refused": family.refused,  # by the start-up rule that refuses them (plan/tune/runnable.py)
        "simulated": family.simulated,
        "memory_pruned": family.memory_pruned,
    }


def payload(
    result: TuneResult, seconds: Optional[float] = None, calibration_source: Optional[str] = None
) -> dict[str, Any]:
    r = result.recipe
    out: dict[str, Any] = {
        "recipe": r.name,
        "hardware": r.hardware,
        "gpus": result.gpus,
        "seq_length": r.model.seq_length,
        "global_batch_size": r.train.global_batch_size,
        "hbm_cap_bytes": int(next(iter(result.families.values())).cap_bytes),
        "kernel_rates": calibration_source or "hardware profile efficiencies (no calibration file)",
    }
    errors = {}
    for name, family in result.families.items():
        out[name] = chosen(family.best, family) if family.best else None
        if family.best is None:
            errors[name] = nothing_fits(name, family)
    out["speedup"] = result.speedup
    if errors:
        out["errors"] = errors
    if seconds is not None:
        out["search_seconds"] = seconds
    return out


def table_rows(result: TuneResult) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    """(header, rows): one column per family, one row per figure."""
    names = list(result.families)
    header = ("", *(TITLES.get(n, n) for n in names))
    runs = [result.families[n].best for n in names]

    def row(title: str, show: Callable[[Evaluated], str]) -> tuple[str, ...]:
        return (title, *(show(run) if run else "nothing fits" for run in runs))

    rows = [
        row("schedule", lambda e: e.label.split(" t")[0]),
        row("tp cp pp dp", lambda e: f"{e.candidate.tp} {e.candidate.cp} {e.candidate.pp} {e.candidate.dp}"),
        row("recompute", lambda e: describe(e.candidate.recompute)),
        row("microbatches", lambda e: str(e.recipe.num_microbatches)),
        row("iteration s", lambda e: f"{e.iteration_time_s:.2f}"),
        row("bubble", lambda e: f"{100 * e.bubble_ratio:.1f}%"),
        row("MFU", lambda e: f"{100 * e.mfu:.1f}%"),
        row("peak GiB", lambda e: f"{e.peak_memory_bytes / _GIB:.1f}"),
        (
            "searched",
            *(f"{f.candidates} cand., {f.simulated} simulated" for f in (result.families[n] for n in names)),
        ),
    ]
    return header, rows
