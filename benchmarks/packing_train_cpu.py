#!/usr/bin/env python
"""``megatron-slim train`` on CPU gloo ranks with ``data.packing`` slimpack against megatron: the same
recipe, documents and steps, one run each, one after the other.

    python benchmarks/packing_train_cpu.py [--iters 8] [--set KEY=VALUE ...]

Reported per method: tokens/s (document tokens over the summed iteration times), seconds per
iteration, microbatches per DP rank and padding share per iteration, the losses; and the tokens/s
ratio slimpack / megatron. Writes ``benchmarks/results/packing_train_cpu.{md,json}``. A benchmark,
not a test: it asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
METHODS = ("slimpack", "megatron")
DEFAULT_SETS = ["parallel.pp=2", "parallel.dp=2", "schedule.num_slices=4"]
NOTES = """What this measures, and what not yet:

* Slice attention keeps to each window's documents (`document_lengths`), so a window costs the
  runtime its documents' `a*s + b*s^2` work, the quantity SlimPack balances over DP ranks; at this
  model size and `seq_length` the quadratic term is small, so most of a window's cost is its token
  count, which every method fills about equally.
* The losses must agree to fp rounding whatever window a document lands in (per-token loss over
  the global batch; `tests/train/test_train_packing.py` asserts it).
* One run each, one after the other, on 2 cores shared with other jobs (see the load average):
  a ratio from this machine is within its noise; the simulator's figures are in
  `packing_sim.md`.
"""


def run(method: str, iters: int, sets: list[str], out: Path) -> dict:
    argv = [sys.executable, "-m", "megatron_slim", "train", "--set", f"train.iters={iters}", "train.log_interval=1"]
    argv += [*sets, f"data.packing={method}", "--json", str(out)]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    subprocess.run(argv, check=True, cwd=REPO, env=env, stderr=subprocess.DEVNULL)
    return json.loads(out.read_text())


def render(args, runs: dict, began: str, load: tuple) -> str:
    slim, mega = runs["slimpack"], runs["megatron"]
    lines = [
        "# `megatron-slim train` on CPU ranks: SlimPack vs Megatron packing",
        "",
        "```",
        f"command: python benchmarks/packing_train_cpu.py --iters {args.iters} "
        + " ".join(f"--set {shlex.quote(s)}" for s in args.set),
        f"runs: megatron-slim train --recipe tiny-cpu --set {' '.join(DEFAULT_SETS + args.set)} "
        f"train.iters={args.iters} data.packing=<method>",
        f"date: {began} UTC",
        f"machine: {os.cpu_count()} CPUs; {platform.platform()}; Python {platform.python_version()}",
        f"load average (1 min) at start {load[0]:.2f}, at end {load[1]:.2f} (the cores are shared)",
        "```",
        "",
        f"tokens/s ratio slimpack / megatron: **{slim['tokens_per_s'] / mega['tokens_per_s']:.3f}** "
        "(same documents and steps; one run each).",
        "",
        "| method | tokens/s | s/iter (mean) | microbatches per DP rank, per iteration | padding share |",
        "|---|---:|---:|---|---:|",
    ]
    for m in METHODS:
        r = runs[m]
        counts = " ".join("/".join(map(str, p["microbatches"])) for p in r["packing"])
        padding = sum(p["padding_share"] for p in r["packing"]) / len(r["packing"])
        mean_s = sum(r["iteration_time_s"]) / len(r["iteration_time_s"])
        lines.append(f"| {m} | {r['tokens_per_s']:,.0f} | {mean_s:.2f} | {counts} | {padding:.1%} |")
    lines += ["", NOTES.rstrip()]
    lines += ["", "Losses per iteration (the same documents, so equal up to fp rounding):"]
    lines += ["", "| iteration | slimpack | megatron |", "|---:|---:|---:|"]
    for i, (a, b) in enumerate(zip(slim["losses"], mega["losses"]), 1):
        lines.append(f"| {i} | {a:.6f} | {b:.6f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--set", action="append", default=[], help="extra recipe override (repeatable)")
    parser.add_argument("--out", default=str(REPO / "benchmarks/results/packing_train_cpu"))
    args = parser.parse_args()
    began = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M")
    start_load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        runs = {m: run(m, args.iters, DEFAULT_SETS + args.set, Path(tmp) / f"{m}.json") for m in METHODS}
    text = render(args, runs, began, (start_load, os.getloadavg()[0]))
    Path(args.out + ".md").write_text(text)
    Path(args.out + ".json").write_text(json.dumps(runs, indent=2) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
