"""Which launcher features compose: every pair of features run through the start-up rules.

A feature is the ``Settings`` a user's flags turn on (``FEATURES``), on a bf16 pp2 base that every
feature accepts alone. A pair composes when no launcher rule refuses the two together; otherwise
the cell names every rule that does. Features that set one field to different values (two CP
engines) are alternatives, not a combination. ``scripts/composition.py`` writes the table to
``docs/composition.md`` and ``tests/plan/test_composition.py`` checks it is current, so the document
follows the rules. Imports no torch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron_slim.plan.startup.rules import RULES
from megatron_slim.plan.startup.settings import LAUNCHER, Settings

# pp2 in bf16 (what a production run uses), at a window every slice count below divides evenly
BASE: dict[str, Any] = dict(pp=2, precision="bf16", seq_length=65536)
_SLICES: dict[str, Any] = dict(slimpipe=True, num_slices=4)
_CP = dict(cp=2)

# feature -> (the flags a user writes, the settings they turn on)
FEATURES: dict[str, tuple[str, dict[str, Any]]] = {
    "SlimPipe slices": ("--use-slimpipe --slimpipe-num-slices 4", _SLICES),
    "balanced slices": (
        "--use-slimpipe --slimpipe-num-slices 4 --slimpipe-slice-policy balanced",
        dict(_SLICES, slice_policy="balanced"),
    ),
    "context exchange": (
        "--use-slimpipe --slimpipe-num-slices 4 --slimpipe-slice-policy exchange",
        dict(_SLICES, slice_policy="exchange"),
    ),
    "vocab on all ranks": (
        "--use-slimpipe --slimpipe-num-slices 4 --slimpipe-vocab-parallel",
        dict(_SLICES, vocab_parallel=True),
    ),
    "activation offload": (
        "--use-slimpipe --slimpipe-num-slices 4 --slimpipe-offload-ratio 0.5",
        dict(_SLICES, offload_ratio=0.5),
    ),
    "vpp": ("--num-layers-per-virtual-pipeline-stage N (2 chunks per stage)", dict(vpp=2)),
    "tp + SP": ("--tensor-model-parallel-size 2 --sequence-parallel", dict(tp=2, sequence_parallel=True)),
    "full recompute": (
        "--recompute-granularity full --recompute-method uniform",
        dict(recompute="full", recompute_method="uniform"),
    ),
    "selective recompute": (
        "--recompute-granularity selective --recompute-modules core_attn",
        dict(recompute="selective", recompute_modules=("core_attn",)),
    ),
    "Megatron CP": ("--context-parallel-size 2", _CP),
    "zeppelin": ("--context-parallel-size 2 --cp-engine zeppelin", dict(_CP, cp_engine="zeppelin")),
    "ring": ("--context-parallel-size 2 --cp-engine ring", dict(_CP, cp_engine="ring")),
    "ulysses": ("--context-parallel-size 2 --cp-engine ulysses", dict(_CP, cp_engine="ulysses")),
    "remap": (
        "--context-parallel-size 2 --cp-engine zeppelin --cp-remap",
        dict(_CP, cp_engine="zeppelin", cp_remap=True),
    ),
    "SlimPack packing": (
        "--use-slimpipe --slimpipe-num-slices 4 --slimpipe-packing slimpack --calculate-per-token-loss",
        dict(_SLICES, packing="slimpack", per_token_loss=True),
    ),
    "document masks": (
        "--reset-attention-mask --reset-position-ids",
        dict(reset_attention_mask=True, reset_position_ids=True),
    ),
    "MoE": ("--num-experts 8", dict(num_experts=8)),
    "dropout": ("--attention-dropout 0.1", dict(attention_dropout=0.1)),
}


def _settings(*features: str) -> Settings | None:
    """The base with ``features`` on; None when two of them set one field differently."""
    fields = dict(BASE)
    for feature in features:
        for key, value in FEATURES[feature][1].items():
            if key in fields and key not in BASE and fields[key] != value:
                return None
            fields[key] = value
    return dataclasses.replace(Settings(), **fields)


def refusals(*features: str) -> list[str] | None:
    """Every launcher rule that refuses ``features`` together (none: they compose); None: alternatives."""
    settings = _settings(*features)
    if settings is None:
        return None
    return [rule.name for rule in RULES if LAUNCHER in rule.callers and rule.broken(settings)]


def markdown() -> str:
    """``docs/composition.md``: the features, then the pair table."""
    names = list(FEATURES)
    cols = [f"{i + 1}" for i in range(len(names))]
    lines = [
        "# What composes: launcher features, pair by pair",
        "",
        "Generated from the start-up rules (`megatron_slim/plan/startup/`) by `python scripts/composition.py`;",
        "`tests/plan/test_composition.py` fails when it is out of date. Each pair is checked on a bf16 pp2 base",
        "with both features on: **ok** composes; otherwise the cell names the rules (`rule-name`) that refuse it,",
        "and the launcher's message says why and what to use instead; `alt` marks alternatives (one field,",
        "two values). The diagonal is the feature alone.",
        "",
        "| # | feature | flags |",
        "|---|---|---|",
    ]
    lines += [f"| {c} | {n} | `{FEATURES[n][0]}` |" for c, n in zip(cols, names)]
    lines += ["", "| | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for c, a in zip(cols, names):
        cells = []
        for b in names:
            refused = refusals(a) if a == b else refusals(a, b)
            cells.append("alt" if refused is None else "ok" if not refused else "<br>".join(f"`{r}`" for r in refused))
        lines.append(f"| **{c}** {a} | " + " | ".join(cells) + " |")
    pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1 :]]
    counted = [refusals(a, b) for a, b in pairs]
    refused_pairs = sum(1 for r in counted if r)
    lines += [
        "",
        f"{len(pairs)} pairs: {sum(1 for r in counted if r == [])} compose, {refused_pairs} refused, "
        f"{sum(1 for r in counted if r is None)} alternatives. Launcher rules in all: "
        f"{sum(LAUNCHER in r.callers for r in RULES)} (of {len(RULES)} start-up rules for every caller).",
    ]
    return "\n".join(lines) + "\n"
