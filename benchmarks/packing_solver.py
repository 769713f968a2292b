#!/usr/bin/env python
"""How long SlimPack takes to plan a 4M-token global batch over 64 DP ranks, and how it packs.

    python benchmarks/packing_solver.py [--repeats 7] [--out benchmarks/results/packing_solver]

Lengths: 90% log-normal mean 4K, 10% log-normal mean 64K up to 256K (``plan/cp/lengths.py`` spec),
drawn until they hold 4M tokens. Cost model: llama2-7b-64k's (pp=4, middle stage), slices of the
MicroPack cap. "phase 1" is the heuristic with its plan built and checked; "whole plan" adds the
MILP refinement (scipy HiGHS, 0.5 s budget) and the final plan; both the median of ``--repeats``
runs after one warm-up (the first import of scipy.optimize is reported apart), in wall clock and
in this process's CPU time (``time.process_time``: the machine is shared, the load average is in
the header). Also prints each packer's iteration time, tokens/s and imbalance under the simple
pipeline model of ``plan/pack/evaluate.py``. Writes ``<out>.md``.

Phase 1's plan is compared with the digest in ``<out>_digests.json`` (recorded before the solver
was made faster): a speed-up must not change the plan. A mismatch exits 1; ``--record-digest``
rewrites the file after an intended change (which must not worsen ``plan_score``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_slim.plan.cost.model import CostModel  # noqa: E402
from megatron_slim.plan.cp.lengths import parse_lengths  # noqa: E402
from megatron_slim.plan.pack.baselines import BASELINES, plan_baseline  # noqa: E402
from megatron_slim.plan.pack.costs import fit_slice_costs  # noqa: E402
from megatron_slim.plan.pack.evaluate import draw_global_batch, evaluate  # noqa: E402
from megatron_slim.plan.pack.slimpack import solve  # noqa: E402
from megatron_slim.plan.recipe import load_recipe  # noqa: E402

SPEC = "mix:0.9*lognormal(mean=4096,sigma=1,min=64,max=65536)+0.1*lognormal(mean=65536,sigma=0.6,min=8192,max=262144)"
TOKENS, DP, CAP, RECIPE = 4 * 1024 * 1024, 64, 16384, "llama2-7b-64k"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--record-digest", action="store_true", help="rewrite <out>_digests.json")
    parser.add_argument("--budget", type=float, default=0.5, help="MILP time budget, seconds")
    parser.add_argument("--out", default=str(REPO / "benchmarks/results/packing_solver"))
    args = parser.parse_args()
    load_start = os.getloadavg()
    lengths = draw_global_batch(parse_lengths(SPEC), TOKENS, seed=0)
    cost = CostModel(load_recipe(RECIPE))
    costs = fit_slice_costs(cost, CAP, max(lengths))
    began = time.perf_counter()
    import scipy.optimize  # noqa: F401

    scipy_import = time.perf_counter() - began
    solve(lengths, costs, DP, CAP, budget_s=args.budget)
    runs = [solve(lengths, costs, DP, CAP, budget_s=args.budget) for _ in range(args.repeats)]
    last = runs[-1]
    load_end = list(os.getloadavg())
    plans, differs = check_digest(Path(args.out + "_digests.json"), last.phase1.digest(), args.record_digest)
    pp = cost.recipe.parallel.pp
    rows = []
    for method in BASELINES:
        rows.append((method, evaluate(plan_baseline(method, lengths, costs, DP, CAP), pp)))
    rows += [("slimpack phase 1", evaluate(last.phase1, pp)), ("slimpack", evaluate(last.plan, pp))]
    lines = [
        "# SlimPack packing solver: 4M-token global batch over 64 DP ranks",
        "",
        "```",
        f"command: python benchmarks/packing_solver.py --repeats {args.repeats} --budget {args.budget}",
        "date: 2026-11-25",
        f"machine: {os.cpu_count()}-core CPU (shared), {platform.machine()}; Python {platform.python_version()}",
        f"load_average: at start {[round(x, 2) for x in load_start]}, at end {[round(x, 2) for x in load_end]}",
        f"phase 1 plan: {plans}",
        f"lengths: {SPEC}; {len(lengths)} samples, {sum(lengths)} tokens, longest {max(lengths)}",
        f"cost model: {RECIPE} (pp={pp}), MicroPack cap {CAP} tokens, dp={DP}",
        "```",
        "",
        "| step | median s (wall / CPU) | max s (wall / CPU) | target |",
        "|---|---:|---:|---:|",
        f"| phase 1 (heuristic + plan) | {_median_max(runs, 'phase1_s', 'phase1_cpu_s')} | <= 0.050 |",
        f"| whole plan (+ MILP, budget {args.budget} s) | {_median_max(runs, 'total_s', 'total_cpu_s')} | <= 1.000 |",
        f"| first import of scipy.optimize (once per process) | {scipy_import:.3f} | | |",
        "",
        f"MILP rounds taken (last run): {last.milp_rounds} ({last.solver}); DP-merged documents: {len(last.merged)}.",
        "",
        "Simple pipeline model (`plan/pack/evaluate.py`), not the DAG simulator; padding share is the",
        "unused share of MicroPack token capacity (SlimPack fills MicroPacks by work, not tokens).",
        "",
        *_packer_table(rows),
    ]
    text = "\n".join(lines) + "\n"
    Path(args.out + ".md").write_text(text)
    print(text)
    if differs:
        sys.exit(1)


def _packer_table(rows: list) -> list[str]:
    megatron = rows[0][1].iteration_time_s
    lines = [
        "| packer | iteration s | tokens/s | vs megatron | fwd imbalance | bwd imbalance | padding | MicroPacks |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, m in rows:
        lines.append(
            f"| {name} | {m.iteration_time_s:.3f} | {m.tokens_per_s:,.0f} | {megatron / m.iteration_time_s:.2f}x "
            f"| {m.fwd_imbalance:.3f} | {m.bwd_imbalance:.3f} | {m.padding_share:.3f} | {m.micropacks} |"
        )
    return lines


def _median_max(runs: list, wall: str, cpu: str) -> str:
    def pair(pick) -> str:
        return f"{pick(getattr(r, wall) for r in runs):.3f} / {pick(getattr(r, cpu) for r in runs):.3f}"

    return f"{pair(statistics.median)} | {pair(max)}"


def check_digest(path: Path, digest: str, record: bool) -> tuple[str, bool]:
    """(a line for the header, whether phase 1's plan differs from the recorded one)."""
    stored = json.loads(path.read_text()) if path.exists() else {"about": "", "phase1": ""}
    if record:
        stored["phase1"] = digest
        path.write_text(json.dumps(stored, indent=1) + "\n")
        return f"digest {digest} recorded in `{path.name}`", False
    if not stored["phase1"]:
        return f"digest {digest} (nothing recorded to compare with)", False
    if stored["phase1"] != digest:
        print(f"phase 1 plan {digest} differs from {stored['phase1']} in {path.name}", file=sys.stderr)
        return f"digest {digest} DIFFERS from the recorded {stored['phase1']} (`{path.name}`)", True
    return f"digest {digest}, identical to the one recorded before the speed work (`{path.name}`)", False


if __name__ == "__main__":
    main()
