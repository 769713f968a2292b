#!/usr/bin/env python
"""Zeppelin planner time per 4M-token batch over 64 CP ranks (8 nodes x 8 H800), CPU wall clock.

Plans every pack of a batch (``plan_zeppelin``: its own placement, the spread one and every baseline
engine's, priced and the cheapest assembled), for each length distribution of
``bench_cp_engines.py`` and each seed; each batch is planned ``--repeat`` times and the fastest
run counts (the machine is shared; the load average is in the header). Also times Zeppelin's own
placement alone (``baselines=False``) to show what pricing the baselines adds. Writes
``<out>/cp_planner_time.md`` and ``.json``.

    python scripts/bench_cp_planner.py [--ranks 64] [--seeds 0,1,2] [--repeat 5] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

from megatron_slim.plan.cp.choose import plan_zeppelin
from megatron_slim.plan.cp.estimate import ZeppelinLayers
from megatron_slim.plan.cp.lengths import make_packs, parse_lengths
from megatron_slim.plan.cp.topology import CPTopology
from megatron_slim.plan.recipe import load_recipe
from megatron_slim.plan.sim.cp.sim import cp_setup

sys.path.insert(0, str(Path(__file__).parent))
from bench_cp_engines import DISTRIBUTIONS, cpu_name, git_commit  # noqa: E402 (a sibling script)

BUDGET_MS = 50.0


def time_batch(packs, topo, costs, layers: ZeppelinLayers, repeat: int) -> tuple[float, float]:
    """Fastest of ``repeat`` runs, milliseconds for the whole batch: (wall clock, this process's CPU
    time). The planner is single-threaded, so on a quiet machine the two agree; on a shared one the
    CPU time leaves out the time the process waited for a core."""
    wall, cpu = float("inf"), float("inf")
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        for pack in packs:
            plan_zeppelin(pack, topo, costs, layers)
        wall, cpu = min(wall, time.perf_counter() - t0), min(cpu, time.process_time() - c0)
    return 1e3 * wall, 1e3 * cpu


def run(recipe_name: str, ranks: int, seeds: list[int], repeat: int) -> list[dict]:
    recipe = load_recipe(recipe_name)
    _, costs = cp_setup(recipe)
    topo = CPTopology.from_hardware(recipe.hardware_profile, ranks, recipe.parallel.tp)
    rows = []
    for dist, spec in DISTRIBUTIONS.items():
        source = parse_lengths(spec)
        for seed in seeds:
            packs = make_packs(source, recipe.model.seq_length, recipe.num_microbatches, seed)
            every = time_batch(packs, topo, costs, ZeppelinLayers(), repeat)
            own = time_batch(packs, topo, costs, ZeppelinLayers(baselines=False), repeat)
            rows.append(
                {
                    "distribution": dist,
                    "seed": seed,
                    "packs": len(packs),
                    "tokens": sum(map(sum, packs)),
                    "sequences": sum(map(len, packs)),
                    "all_candidates_ms": every[0],
                    "all_candidates_cpu_ms": every[1],
                    "own_only_ms": own[0],
                    "own_only_cpu_ms": own[1],
                }
            )
    return rows


def markdown(rows: list[dict], header: dict) -> str:
    worst = max(r["all_candidates_ms"] for r in rows)
    worst_cpu = max(r["all_candidates_cpu_ms"] for r in rows)
    lines = [
        "# Zeppelin planner time per batch",
        "",
        f"- command: `{header['command']}`",
        f"- date: {header['date']}",
        f"- machine: {header['platform']}; CPU: {header['cpu']} ({header['cores']} cores, shared with other "
        f"jobs; load average at start {header['load']}); Python {header['python']}",
        f"- commit: {header['commit']} (plus the working tree)",
        f"- {header['ranks']} CP ranks ({header['topology']}), recipe `{header['recipe']}`; a batch is "
        f"{rows[0]['packs']} packs = {rows[0]['tokens']:,} tokens; fastest of {header['repeat']} runs per batch",
        f"- budget {BUDGET_MS:.0f} ms per batch; slowest batch here {worst:.1f} ms wall clock, "
        f"{worst_cpu:.1f} ms CPU time ({'within' if worst_cpu <= BUDGET_MS else 'OVER'} budget by CPU time)",
        "",
        "| distribution | seed | sequences | all candidates ms (wall / CPU) | own placements only ms (wall / CPU) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['distribution']} | {r['seed']} | {r['sequences']} | {r['all_candidates_ms']:.1f} / "
            f"{r['all_candidates_cpu_ms']:.1f} | {r['own_only_ms']:.1f} / {r['own_only_cpu_ms']:.1f} |"
        )
    mean_all = statistics.fmean(r["all_candidates_cpu_ms"] for r in rows)
    mean_own = statistics.fmean(r["own_only_cpu_ms"] for r in rows)
    lines += [
        "",
        f"Mean CPU time: all candidates {mean_all:.1f} ms, Zeppelin's own placements only {mean_own:.1f} ms "
        "(pricing and assembling the baselines' placements is the difference).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", default="zeppelin-7b-h800")
    parser.add_argument("--ranks", type=int, default=64, help="CP ranks (default 64)")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    parser.add_argument("--repeat", type=int, default=5, help="runs per batch; the fastest counts (default 5)")
    parser.add_argument("--out", default="benchmarks/results", help="output folder")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    recipe = load_recipe(args.recipe)
    topo = CPTopology.from_hardware(recipe.hardware_profile, args.ranks, recipe.parallel.tp)
    header = {
        "command": "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])]),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "platform": platform.platform(),
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "load": " ".join(f"{x:.1f}" for x in os.getloadavg()),
        "python": platform.python_version(),
        "commit": git_commit(),
        "ranks": args.ranks,
        "topology": topo.describe(),
        "recipe": args.recipe,
        "repeat": args.repeat,
    }
    rows = run(args.recipe, args.ranks, seeds, args.repeat)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(rows, header)
    (out / "cp_planner_time.md").write_text(text)
    (out / "cp_planner_time.json").write_text(json.dumps({"header": header, "rows": rows}, indent=1) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
