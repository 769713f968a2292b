#!/usr/bin/env python
"""Zeppelin planner time per 4M-token batch over 64 CP ranks (8 nodes x 8 H800): CPU time and wall clock.

Plans every pack of a batch (``plan_zeppelin``: its own placement, the spread one and every baseline
engine's, priced and the cheapest assembled), for each length distribution of
``bench_cp_engines.py`` and each seed; each batch is planned ``--repeat`` times and the median
counts, of this process's CPU time (``time.process_time``) and of wall clock apart (the machine
is shared; the load average is in the header). Also times Zeppelin's own placement alone
(``baselines=False``) to show what pricing the baselines adds. Writes
``<out>/cp_planner_time.md`` and ``.json``.

Before timing, every batch's plans are hashed and compared with ``<out>/cp_planner_digests.json``
(recorded before the planner was made faster): a speed-up must not change a pick. A mismatch
exits 1; ``--record-digests`` rewrites the file after an intended change of picks.

``--before <json>`` (the ``.json`` of an earlier run, e.g. of the planner before a speed-up, run on
the same machine just before) adds its CPU times as a "before" column and a before/after summary.

    python scripts/bench_cp_planner.py [--ranks 64] [--seeds 0,1,2] [--repeat 7] [--out benchmarks/results]
                                       [--before earlier/cp_planner_time.json]
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
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
    """Median of ``repeat`` runs, milliseconds for the whole batch: (wall clock, this process's CPU
    time). The planner is single-threaded, so on a quiet machine the two agree; on a shared one the
    CPU time leaves out the time the process waited for a core."""
    wall, cpu = [], []
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        for pack in packs:
            plan_zeppelin(pack, topo, costs, layers)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return 1e3 * statistics.median(wall), 1e3 * statistics.median(cpu)


def batch_digest(packs, topo, costs, layers: ZeppelinLayers) -> str:
    """sha256 over the plan digests of every pack of the batch."""
    digest = hashlib.sha256()
    for pack in packs:
        digest.update(plan_zeppelin(pack, topo, costs, layers).digest().encode())
    return digest.hexdigest()


VARIANTS = {"all_candidates": ZeppelinLayers(), "own_only": ZeppelinLayers(baselines=False)}


def run(recipe_name: str, ranks: int, seeds: list[int], repeat: int, digests: dict[str, str]) -> list[dict]:
    """Rows of timings; ``digests`` (key -> batch digest) gets every batch's plans' digest."""
    recipe = load_recipe(recipe_name)
    _, costs = cp_setup(recipe)
    topo = CPTopology.from_hardware(recipe.hardware_profile, ranks, recipe.parallel.tp)
    rows = []
    for dist, spec in DISTRIBUTIONS.items():
        source = parse_lengths(spec)
        for seed in seeds:
            packs = make_packs(source, recipe.model.seq_length, recipe.num_microbatches, seed)
            for variant, layers in VARIANTS.items():
                digests[f"{recipe_name}|{ranks}|{dist}|{seed}|{variant}"] = batch_digest(packs, topo, costs, layers)
            every = time_batch(packs, topo, costs, VARIANTS["all_candidates"], repeat)
            own = time_batch(packs, topo, costs, VARIANTS["own_only"], repeat)
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


def markdown(rows: list[dict], header: dict, before: dict[tuple[str, int], dict] | None = None) -> str:
    """The results table; ``before``: an earlier run's rows by (distribution, seed), for comparison."""
    worst = max(r["all_candidates_ms"] for r in rows)
    worst_cpu = max(r["all_candidates_cpu_ms"] for r in rows)
    lines = [
        "# Zeppelin planner time per batch",
        "",
        f"- command: `{header['command']}`",
        f"- date: {header['date']}",
        f"- machine: {header['platform']}; CPU: {header['cpu']} ({header['cores']} cores, shared with other "
        f"jobs; load average at start {header['load']}, at end {header['load_end']}); Python {header['python']}",
        f"- commit: {header['commit']} (plus the working tree)",
        f"- {header['ranks']} CP ranks ({header['topology']}), recipe `{header['recipe']}`; a batch is "
        f"{rows[0]['packs']} packs = {rows[0]['tokens']:,} tokens; median of {header['repeat']} runs per batch",
        f"- plans: {header['digests']}",
        f"- budget {BUDGET_MS:.0f} ms per batch; slowest batch here {worst:.1f} ms wall clock, "
        f"{worst_cpu:.1f} ms CPU time ({'within' if worst_cpu <= BUDGET_MS else 'OVER'} budget by CPU time)",
        "",
        "| distribution | seed | sequences | all candidates ms (wall / CPU) | own placements only ms (wall / CPU) |"
        + (" before: all candidates ms CPU |" if before else ""),
        "|---|---|---|---|---|" + ("---|" if before else ""),
    ]
    for r in rows:
        then = before.get((r["distribution"], r["seed"])) if before else None
        lines.append(
            f"| {r['distribution']} | {r['seed']} | {r['sequences']} | {r['all_candidates_ms']:.1f} / "
            f"{r['all_candidates_cpu_ms']:.1f} | {r['own_only_ms']:.1f} / {r['own_only_cpu_ms']:.1f} |"
            + (f" {then['all_candidates_cpu_ms']:.1f} |" if then else (" - |" if before else ""))
        )
    mean_all = statistics.fmean(r["all_candidates_cpu_ms"] for r in rows)
    mean_own = statistics.fmean(r["own_only_cpu_ms"] for r in rows)
    lines += [
        "",
        f"Mean CPU time: all candidates {mean_all:.1f} ms, Zeppelin's own placements only {mean_own:.1f} ms "
        "(pricing and assembling the baselines' placements is the difference).",
        "",
    ]
    lines += ["| distribution | slowest / mean ms CPU" + (" | before: slowest / mean ms CPU |" if before else " |")]
    lines += ["|---|---|" + ("---|" if before else "")]
    for dist in dict.fromkeys(r["distribution"] for r in rows):
        cells = [[r["all_candidates_cpu_ms"] for r in rows if r["distribution"] == dist]]
        if before:
            cells.append([r["all_candidates_cpu_ms"] for (d, _), r in before.items() if d == dist] or [math.nan])
        lines.append(f"| {dist} | " + " | ".join(f"{max(c):.1f} / {statistics.fmean(c):.1f}" for c in cells) + " |")
    lines.append("")
    if before:
        then = list(before.values())
        lines += [
            f"Before (`{header['before']}`, same command and machine): slowest batch "
            f"{max(r['all_candidates_cpu_ms'] for r in then):.1f} ms CPU, mean "
            f"{statistics.fmean(r['all_candidates_cpu_ms'] for r in then):.1f} ms; after: slowest {worst_cpu:.1f} ms, "
            f"mean {mean_all:.1f} ms.",
            "",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", default="zeppelin-7b-h800")
    parser.add_argument("--ranks", type=int, default=64, help="CP ranks (default 64)")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    parser.add_argument("--repeat", type=int, default=7, help="runs per batch; the median counts (default 7)")
    parser.add_argument(
        "--record-digests", action="store_true", help="rewrite <out>/cp_planner_digests.json (after an intended change)"
    )
    parser.add_argument("--out", default="benchmarks/results", help="output folder")
    parser.add_argument("--before", help="cp_planner_time.json of an earlier run to compare with (optional)")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    recipe = load_recipe(args.recipe)
    topo = CPTopology.from_hardware(recipe.hardware_profile, args.ranks, recipe.parallel.tp)
    header = {
        "command": "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])]),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
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
    digests: dict[str, str] = {}
    rows = run(args.recipe, args.ranks, seeds, args.repeat, digests)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    header["load_end"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    header["digests"], changed = check_digests(out / "cp_planner_digests.json", digests, args.record_digests)
    before = None
    if args.before:
        header["before"] = args.before
        earlier = json.loads(Path(args.before).read_text())["rows"]
        before = {(r["distribution"], r["seed"]): r for r in earlier}
    text = markdown(rows, header, before)
    (out / "cp_planner_time.md").write_text(text)
    (out / "cp_planner_time.json").write_text(json.dumps({"header": header, "rows": rows}, indent=1) + "\n")
    print(text)
    return 1 if changed else 0


def check_digests(path: Path, digests: dict[str, str], record: bool) -> tuple[str, list[str]]:
    """(a line for the header, the batches whose plans differ from the recorded ones)."""
    stored = json.loads(path.read_text()) if path.exists() else {"about": "", "digests": {}}
    if record:
        stored["digests"].update(digests)
        path.write_text(json.dumps(stored, indent=1) + "\n")
        return f"digests of {len(digests)} batches recorded in `{path.name}`", []
    known = {k: v for k, v in digests.items() if k in stored["digests"]}
    changed = sorted(k for k, v in known.items() if stored["digests"][k] != v)
    for key in changed:
        print(f"plans differ from {path.name}: {key}", file=sys.stderr)
    if changed:
        return f"{len(changed)} of {len(known)} batches' plans DIFFER from `{path.name}`", changed
    return f"identical to the {len(known)} recorded batch digests in `{path.name}` (of {len(digests)} planned)", []


if __name__ == "__main__":
    sys.exit(main())
