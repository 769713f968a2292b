#!/usr/bin/env python
"""Compare context-parallel engines on the simulator: Zeppelin vs ring (TE p2p), Ulysses, a2a+p2p,
all-gather (Llama-3) and Megatron dynamic CP, plus Zeppelin ablations (no routing / no remap / no
baseline placements among its candidates).

The last two distributions (bimodal chat + documents, uniform 16K-128K) were added after the
planner's candidate search and were not tuned on. Also writes ``<out>/cp_engines_packs.md``: per
pack, the placement Zeppelin kept and the cost model's breakdown next to the best other engine's.

Every engine runs the same 4M-token batches (the recipe's packs) drawn from each length
distribution with several seeds. Writes ``<out>/cp_engines.md`` and ``<out>/cp_engines.json``
with the exact command, machine and date at the top. Numbers are simulated (plan/sim/cp/sim.py),
not measured.

    python scripts/bench_cp_engines.py [--recipe zeppelin-7b-h800] [--seeds 0,1,2] [--out benchmarks/results]
        [--calibration hopper-cudnn --name cp_engines_hopper_cudnn]

``--calibration`` prices every engine (and Zeppelin's planning) with measured kernel rates, whose
small-block efficiency falls steeply below 2K tokens (docs/calibration.md); ``--name`` is the stem
of the files written (default ``cp_engines``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from megatron_slim.plan.cost.calibration import Calibration, load_calibration
from megatron_slim.plan.cp.engines import ENGINES
from megatron_slim.plan.cp.lengths import make_packs, parse_lengths
from megatron_slim.plan.recipe import load_recipe
from megatron_slim.plan.sim.cp.sim import cp_setup, simulate_cp

sys.path.insert(0, str(Path(__file__).parent))
import cp_pack_breakdown  # noqa: E402 (a sibling module of this script)

DISTRIBUTIONS = {
    "short-skewed (lognormal mean 4K)": "lognormal:mean=4096,sigma=1.2,min=256,max=65536",
    "short-skewed (lognormal mean 8K)": "lognormal:mean=8192,sigma=1.1,min=1024,max=65536",
    "long-tailed (90% mean 4K, 10% mean 64K up to 256K)": "mix:0.9*lognormal(mean=4096,sigma=1.0,min=256,max=32768)"
    "+0.1*lognormal(mean=65536,sigma=1.0,min=16384,max=262144)",
    "bimodal chat + documents (70% mean 2K, 30% mean 48K; not tuned on)": "mix:0.7*lognormal(mean=2048,sigma=0.8,"
    "min=128,max=16384)+0.3*lognormal(mean=49152,sigma=0.6,min=16384,max=262144)",
    "uniform 16K-128K (not tuned on)": "uniform:min=16384,max=131072",
}
# (label, engine, overrides for simulate_cp)
VARIANTS = [(e, e, {}) for e in ENGINES] + [
    # Zeppelin's own placements only (hierarchical and spread), no baseline engine's among them
    ("zeppelin -baselines", "zeppelin", {"baselines": False}),
    ("zeppelin -remap", "zeppelin", {"remap": False}),
    ("zeppelin -routing", "zeppelin", {"routing": False}),
    # without the a2a+ring splits, long sequences ride flat zigzag rings across nodes: the
    # routing layer's own effect shows here
    ("zeppelin -hierarchical", "zeppelin", {"hierarchical": False}),
    ("zeppelin -hierarchical -routing", "zeppelin", {"hierarchical": False, "routing": False}),
]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).parent,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run(recipe_name: str, seeds: list[int], calibration: Calibration | None = None) -> dict:
    recipe = load_recipe(recipe_name)
    topo, costs = cp_setup(recipe, calibration)
    rows, pack_rows = [], []
    for dist, spec in DISTRIBUTIONS.items():
        source = parse_lengths(spec)
        for seed in seeds:
            packs = make_packs(source, recipe.model.seq_length, recipe.num_microbatches, seed)
            lengths = [s for p in packs for s in p]
            pack_times: dict[str, list[float]] = {}
            for label, engine, extra in VARIANTS:
                t0 = time.perf_counter()
                res = simulate_cp(recipe, engine, packs, topo=topo, costs=costs, **extra)
                pack_times[label] = [p.time_s for p in res.packs]
                n = len(res.ranks)
                rows.append(
                    {
                        "distribution": dist,
                        "spec": spec,
                        "seed": seed,
                        "variant": label,
                        "engine": engine,
                        "iteration_time_s": res.iteration_time_s,
                        "tokens_per_s": res.tokens_per_s,
                        "mfu": res.mfu,
                        "idle_fraction": sum(r.idle_s for r in res.ranks) / n / res.iteration_time_s,
                        "inter_node_gb_per_rank": sum(r.inter_node_bytes for r in res.ranks) / n / 1e9,
                        "busiest_rank_busy_s": max(r.attention_s + r.linear_s for r in res.ranks),
                        "mean_rank_busy_s": sum(r.attention_s + r.linear_s for r in res.ranks) / n,
                        "sequences": len(lengths),
                        "longest": max(lengths),
                        "mean_length": statistics.fmean(lengths),
                        "plan_digests": [p.digest[:16] for p in res.packs],
                        "picked": [p.plan["picked"] for p in res.packs],
                        "wall_s": time.perf_counter() - t0,
                    }
                )
            layers = recipe.model.num_layers
            pack_rows += cp_pack_breakdown.pack_rows(dist, seed, packs, pack_times, topo, costs, layers)
    for row in rows:
        ring = next(
            r
            for r in rows
            if r["distribution"] == row["distribution"] and r["seed"] == row["seed"] and r["variant"] == "ring"
        )
        row["speedup_vs_ring"] = ring["iteration_time_s"] / row["iteration_time_s"]
    return {
        "recipe": recipe_name,
        "hardware": recipe.hardware,
        "cp": recipe.parallel.cp,
        "ranks_per_node": topo.ranks_per_node,
        "pack_length": recipe.model.seq_length,
        "packs_per_iteration": recipe.num_microbatches,
        "tokens_per_iteration": recipe.model.seq_length * recipe.num_microbatches,
        "seeds": seeds,
        "distributions": DISTRIBUTIONS,
        "rows": rows,
        "packs": pack_rows,
    }


def summarise(rows: list[dict]) -> list[dict]:
    out = []
    for dist in dict.fromkeys(r["distribution"] for r in rows):
        for label, _, _ in VARIANTS:
            sel = [r for r in rows if r["distribution"] == dist and r["variant"] == label]
            out.append(
                {
                    "distribution": dist,
                    "variant": label,
                    "iteration_time_s": statistics.fmean(r["iteration_time_s"] for r in sel),
                    "min_s": min(r["iteration_time_s"] for r in sel),
                    "max_s": max(r["iteration_time_s"] for r in sel),
                    "tokens_per_s": statistics.fmean(r["tokens_per_s"] for r in sel),
                    "mfu": statistics.fmean(r["mfu"] for r in sel),
                    "speedup_vs_ring": statistics.fmean(r["speedup_vs_ring"] for r in sel),
                    "idle_fraction": statistics.fmean(r["idle_fraction"] for r in sel),
                    "inter_node_gb_per_rank": statistics.fmean(r["inter_node_gb_per_rank"] for r in sel),
                    "imbalance": statistics.fmean(r["busiest_rank_busy_s"] / r["mean_rank_busy_s"] for r in sel),
                }
            )
    return out


def verdict(data: dict) -> list[str]:
    """Zeppelin against the fastest other engine on every (distribution, seed)."""
    lines = [
        "## Zeppelin against the fastest other engine, every distribution and seed",
        "",
        "| distribution | seed | zeppelin s | fastest other | its s | other / zeppelin | zeppelin picks per pack |",
        "|---|---|---|---|---|---|---|",
    ]
    for dist in data["distributions"]:
        for seed in data["seeds"]:
            sel = {r["variant"]: r for r in data["rows"] if r["distribution"] == dist and r["seed"] == seed}
            zep = sel["zeppelin"]
            other = min((e for e in ENGINES if e != "zeppelin"), key=lambda e: sel[e]["iteration_time_s"])
            counts: dict[str, int] = {}
            for p in zep["picked"]:
                counts[p] = counts.get(p, 0) + 1
            picks = ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))
            lines.append(
                f"| {dist} | {seed} | {zep['iteration_time_s']:.3f} | {other} | "
                f"{sel[other]['iteration_time_s']:.3f} | "
                f"{sel[other]['iteration_time_s'] / zep['iteration_time_s']:.3f} | "
                f"{picks} |"
            )
    return [*lines, ""]


def header_lines(data: dict, header: dict) -> list[str]:
    return [
        f"- command: `{header['command']}`",
        f"- date: {header['date']}",
        f"- machine: {header['platform']}; CPU: {header['cpu']} ({header['cores']} cores, shared); "
        f"Python {header['python']}",
        f"- commit: {header['commit']} (plus the working tree)",
        f"- recipe `{data['recipe']}` on `{data['hardware']}`: CP over {data['cp']} GPUs "
        f"({data['cp'] // data['ranks_per_node']} nodes x {data['ranks_per_node']}), "
        f"{data['packs_per_iteration']} packs x {data['pack_length']} tokens = "
        f"{data['tokens_per_iteration']:,} tokens per iteration; seeds {data['seeds']}",
        f"- kernel rates: {header.get('kernel_rates', 'hardware profile efficiencies')}",
    ]


def markdown(data: dict, summary: list[dict], header: dict) -> str:
    lines = [
        "# Context-parallel engines: simulated iteration time",
        "",
        *header_lines(data, header),
        "- Zeppelin's planner prices, per pack, its own placement, the same with its inter-node "
        "sequences spread over every rank, its own without the remap, and each other engine's placement "
        "with one cost model "
        "(`plan/cp/price.py`), and keeps the cheapest (`plan/cp/choose.py`); per-pack picks and "
        "breakdowns: `cp_engines_packs.md`",
        "- numbers come from the simulator (`megatron_slim/plan/sim/cp/sim.py`), not from GPUs; "
        "speedup = ring time / engine time per (distribution, seed), averaged",
        "",
    ]
    for dist, spec in data["distributions"].items():
        lines += [
            f"## {dist}",
            "",
            f"`--lengths {spec}`",
            "",
            "| engine | iteration s (mean) | min..max s | tokens/s | MFU | speedup vs ring | idle | "
            "busiest/mean busy | inter-node GB/rank |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for s in (s for s in summary if s["distribution"] == dist):
            lines.append(
                f"| {s['variant']} | {s['iteration_time_s']:.2f} | {s['min_s']:.2f}..{s['max_s']:.2f} | "
                f"{s['tokens_per_s']:,.0f} | {100 * s['mfu']:.1f}% | {s['speedup_vs_ring']:.2f}x | "
                f"{100 * s['idle_fraction']:.0f}% | {s['imbalance']:.2f} | "
                f"{s['inter_node_gb_per_rank']:.0f} |"
            )
        lines.append("")
    lines += verdict(data)
    lines += [
        "## Averages over all distributions and seeds",
        "",
        "| engine | iteration s | speedup vs ring |",
        "|---|---|---|",
    ]
    for label, _, _ in VARIANTS:
        sel = [r for r in data["rows"] if r["variant"] == label]
        lines.append(
            f"| {label} | {statistics.fmean(r['iteration_time_s'] for r in sel):.2f} | "
            f"{statistics.fmean(r['speedup_vs_ring'] for r in sel):.2f}x |"
        )
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", default="zeppelin-7b-h800")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    parser.add_argument("--out", default="benchmarks/results", help="output folder")
    parser.add_argument("--calibration", help="measured kernel rates: a shipped name or a file (docs/calibration.md)")
    parser.add_argument("--name", default="cp_engines", help="stem of the files written (default cp_engines)")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    calibration = load_calibration(args.calibration) if args.calibration else None
    started = time.perf_counter()
    data = run(args.recipe, seeds, calibration)
    header = {
        "command": "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])]),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "platform": platform.platform(),
        "cpu": cpu_name(),
        "python": platform.python_version(),
        "cores": os.cpu_count(),
        "commit": git_commit(),
        "wall_s": round(time.perf_counter() - started, 1),
        "kernel_rates": calibration.source if calibration else "hardware profile efficiencies",
    }
    summary = summarise(data["rows"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.md").write_text(markdown(data, summary, header))
    (out / f"{args.name}_packs.md").write_text(cp_pack_breakdown.markdown(data["packs"], header_lines(data, header)))
    (out / f"{args.name}.json").write_text(json.dumps({"header": header, **data, "summary": summary}, indent=1) + "\n")
    print(markdown(data, summary, header))
    print(f"wrote {out / (args.name + '.md')} and {out / (args.name + '.json')} in {header['wall_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
