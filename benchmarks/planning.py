#!/usr/bin/env python
"""How long planning a pipeline schedule takes: generate, lower, validate (and the runtime's cached
second request) for every shipped recipe and for 2048K-class shapes (pp16 vpp5, 64 slices).

    python benchmarks/planning.py [--repeats 3] [--out benchmarks/results/planning]

Each figure is the median of ``--repeats`` fresh plannings (the executable cache cleared between
them); "cached" is a second ``executable`` call for the same shape, what every training iteration
after the first pays. Writes ``<out>.{md,json}``. A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_slim.plan.recipe import available_recipes, load_recipe  # noqa: E402
from megatron_slim.plan.schedule.executable import executable  # noqa: E402
from megatron_slim.plan.schedule.generators import generate  # noqa: E402
from megatron_slim.plan.schedule.lower import lower  # noqa: E402
from megatron_slim.plan.schedule.validate import check_link_order, validate  # noqa: E402

# 2048K on 256 GPUs as the SlimPipe paper runs it (p16 v5, 64 slices); 4M tokens per batch is two
# sequences, and 16 microbatches is the larger batch a user may run with the same split.
LONG_SHAPES = [
    ("2048K p16 v5 n64, 2 microbatches", ("slimpipe", 16, 5, 2, 64)),
    ("2048K p16 v5 n64, 16 microbatches", ("slimpipe", 16, 5, 16, 64)),
]


def recipe_shapes() -> list[tuple[str, tuple[str, int, int, int, int]]]:
    shapes = []
    for name in available_recipes():
        r = load_recipe(name)
        shapes.append(
            (name, (r.schedule.kind, r.parallel.pp, r.parallel.vpp, r.num_microbatches, r.schedule.num_slices))
        )
    return shapes


def time_one(shape: tuple[str, int, int, int, int], repeats: int) -> dict:
    phases: dict[str, list[float]] = {"generate": [], "lower": [], "validate": [], "cached": []}
    actions = 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        generated = generate(*shape)
        t1 = time.perf_counter()
        lowered = lower(generated)
        t2 = time.perf_counter()
        check_link_order(validate(lowered))
        t3 = time.perf_counter()
        executable.cache_clear()
        executable(*shape)
        t4 = time.perf_counter()
        executable(*shape)
        t5 = time.perf_counter()
        phases["generate"].append(t1 - t0)
        phases["lower"].append(t2 - t1)
        phases["validate"].append(t3 - t2)
        phases["cached"].append(t5 - t4)
        actions = sum(map(len, lowered.ranks))
    out = {k: statistics.median(v) for k, v in phases.items()}
    out["total"] = out["generate"] + out["lower"] + out["validate"]
    out["actions"] = actions
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/planning"))
    args = ap.parse_args()
    started = datetime.datetime.now(datetime.UTC)
    rows = []
    for label, shape in recipe_shapes() + LONG_SHAPES:
        rows.append(
            {
                "case": label,
                "shape": dict(zip(("kind", "pp", "vpp", "microbatches", "slices"), shape)),
                **time_one(shape, args.repeats),
            }
        )
        print(f"{label}: {rows[-1]['actions']} actions, {rows[-1]['total']:.3f} s", flush=True)
    cpu = platform.processor() or platform.machine()
    machine = f"{os.cpu_count()} CPUs, {cpu}; {platform.platform()}; Python {platform.python_version()}"
    meta = {
        "command": "python benchmarks/planning.py",
        "date": started.strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine,
        "load_average": list(os.getloadavg()),
        "repeats": args.repeats,
    }
    Path(args.out + ".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = [
        "# Planning time of pipeline schedules: generate + lower + validate",
        "",
        "```",
        *(f"{k}: {v}" for k, v in meta.items()),
        "```",
        "",
        "Seconds, median of the repeats. cached: the runtime's second request for the same shape "
        "(`plan.schedule.executable` keeps the lowered, validated schedule per shape).",
        "",
        "| case | kind pp vpp microbatches slices | actions | generate | lower | validate | total | cached |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        s = r["shape"]
        lines.append(
            f"| {r['case']} | {s['kind']} {s['pp']} {s['vpp']} {s['microbatches']} {s['slices']} | {r['actions']} | "
            f"{r['generate']:.3f} | {r['lower']:.3f} | {r['validate']:.3f} | {r['total']:.3f} | {r['cached']:.6f} |"
        )
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
