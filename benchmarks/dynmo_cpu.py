#!/usr/bin/env python
"""Measured DynMo rebalancing on CPU gloo ranks: `megatron-slim train`, pp=4, with the first half of
the decoder layers frozen from iteration ``--freeze-at``, under ``dynmo.rebalance=dynmo`` and the
same run under ``static``.

    python benchmarks/dynmo_cpu.py [--layers 16] [--iters 24] [--freeze-at 4] [--interval 8] [--layers-only]

The embedding freezes with layer 0 (``dynmo.freeze_embedding``), so the frozen stages run no
backward; ``--layers-only`` leaves it training (frozen layers then still pass input gradients back).

Per run: the per-iteration wall time of every iteration (forward, backward, optimizer; the
migration itself is reported apart), the trigger's decisions, and the load average around it.
Reported: in the rebalanced run, the mean step before the move (frozen, old split) against after
it; and the rebalanced run against the static one over the same iterations after the move.
Writes ``benchmarks/results/dynmo_cpu.{md,json}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def sets(layers: int, iters: int, freeze_at: int, embedding: bool) -> list[str]:
    half = layers // 2
    return [
        f"dynmo.freeze_embedding={str(embedding).lower()}",
        f"model.num_layers={layers}",
        "model.seq_length=256",
        "train.global_batch_size=8",
        f"train.iters={iters}",
        "train.warmup_iters=2",
        "parallel.pp=4",
        "data.max_files=60",
        "dynmo.profile=true",
        f'dynmo.freeze="{freeze_at}:0-{half - 1}"',
    ]


def run(policy: str, args, out: Path) -> dict:
    overrides = sets(args.layers, args.iters, args.freeze_at, not args.layers_only)
    command = ["megatron-slim", "train", "--recipe", "tiny-cpu", "--set", *overrides]
    command += ["--dynmo-rebalance", policy, "--dynmo-rebalance-interval", str(args.interval), "--json", str(out)]
    load_before = os.getloadavg()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    subprocess.run([sys.executable, "-m", "megatron_slim", *command[1:]], check=True, env=env, cwd=REPO)
    data = json.loads(out.read_text())
    return {
        "command": " ".join(c if " " not in c and '"' not in c else repr(c) for c in command),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "iteration_time_s": data["iteration_time_s"],
        "losses": data["losses"],
        "decisions": data["dynmo"].get("rebalance", []),
    }


def mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def summary(static: dict, dynmo: dict, freeze_at: int) -> dict:
    moves = [d["iteration"] for d in dynmo["decisions"] if d["move"]]
    first = moves[0] if moves else None
    last = moves[-1] if moves else len(dynmo["iteration_time_s"])
    t_dyn, t_static, nan = dynmo["iteration_time_s"], static["iteration_time_s"], float("nan")
    # iterations numbered from 1; skip the first frozen iteration (the freeze takes effect in it)
    before = t_dyn[freeze_at:first] if first else []
    after_dyn, after_static = t_dyn[last:], t_static[last:]
    return {
        "first_move_iteration": first,
        "last_move_iteration": moves[-1] if moves else None,
        "dynmo_mean_step_before_move_s": mean(before),
        "dynmo_mean_step_after_move_s": mean(after_dyn),
        "static_mean_step_same_iterations_s": mean(after_static),
        "in_run_speedup": mean(before) / mean(after_dyn) if before else nan,
        "in_run_speedup_of_medians": (statistics.median(before) / statistics.median(after_dyn)) if before else nan,
        "speedup_over_static_of_medians": statistics.median(after_static) / statistics.median(after_dyn),
        "speedup_over_static": mean(after_static) / mean(after_dyn),
        # iterations 2..freeze_at-1 run the same split and model in both runs: their ratio is run-to-run noise
        "static_over_dynmo_identical_iterations": mean(t_static[1 : freeze_at - 1]) / mean(t_dyn[1 : freeze_at - 1]),
        "max_loss_relative_difference": max(abs(a - b) / abs(b) for a, b in zip(dynmo["losses"], static["losses"])),
    }


READING = """How to read this: the machine has 2 CPU cores, shared with other jobs (load averages above), for
4 rank processes. Ranks time-share the cores, so a stage that waits yields its core to a busy one: the
step time follows the total work over 2 cores more than the slowest stage, which is what rebalancing
shortens. Moving layers does not change the total work, so on this machine the in-run comparison
(same process, the split before the move against after it) shows no clear gain; the per-layer times the
trigger reads are inflated by time-sharing too. The static-run comparison is dominated by run-to-run
noise: `static_over_dynmo_identical_iterations` compares iterations that run the same split and model
in both runs, and is far from 1. The losses match exactly (fp32), so the move kept all state. A fair
measurement needs one core per rank (16-core host, or GPUs)."""

READING_DEDICATED = """How to read this: each of the 4 rank processes had a core of its own (see the note), so a
stage's time is its own work and the step follows the slowest stage, which is what rebalancing
shortens. The in-run comparison (the same process: the frozen model on the old split before the move
against the new split after it) is the cleanest figure. The two runs ran one after the other, so the
comparison with the static run also carries what changed on the machine between them:
`static_over_dynmo_identical_iterations` (iterations that run the same split and model in both runs)
shows how large that is. The losses match exactly (fp32), so the move kept all state."""


def markdown(meta: dict, runs: dict, s: dict) -> str:
    lines = ["# DynMo rebalancing, measured on CPU gloo ranks (pp=4, freezing)", "", "```"]
    lines += [f"{k}: {v}" for k, v in meta.items()] + ["```", ""]
    for policy, r in runs.items():
        lines += [
            f"`{policy}`: `{r['command']}`  ",
            f"load average before / after: {r['load_average_before']} / {r['load_average_after']}",
            "",
        ]
    lines += ["Decisions of the rebalanced run:", "", "| iteration | split | proposed | move | predicted step ms |"]
    lines += ["|---|---|---|---|---|"]
    for d in runs["dynmo"]["decisions"]:
        lines.append(
            f"| {d['iteration']} | {d['before']} | {d['proposed']} | {d['move']} | "
            f"{d['step_before_s'] * 1e3:.0f} -> {d['step_after_s'] * 1e3:.0f} |"
        )
    lines += ["", "| measure | value |", "|---|---|"]
    lines += [f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in s.items()]
    cores = int(meta["machine"].split()[0])
    lines += ["", READING if cores < 8 else READING_DEDICATED, "", "Per-iteration seconds (static, dynmo):", "", "```"]
    for i, (a, b) in enumerate(zip(runs["static"]["iteration_time_s"], runs["dynmo"]["iteration_time_s"]), 1):
        lines.append(f"{i:3d}  {a:.3f}  {b:.3f}")
    return "\n".join(lines + ["```", ""])


def rerender(path: str) -> None:
    """Rewrite ``path``.md (and the summary in ``path``.json) from the runs saved in ``path``.json."""
    data = json.loads(Path(path + ".json").read_text())
    freeze_at = int(data["runs"]["dynmo"]["command"].split('dynmo.freeze="')[1].split(":")[0])
    data["summary"] = summary(data["runs"]["static"], data["runs"]["dynmo"], freeze_at)
    Path(path + ".json").write_text(json.dumps(data, indent=2) + "\n")
    Path(path + ".md").write_text(markdown(data["meta"], data["runs"], data["summary"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--iters", type=int, default=24)
    ap.add_argument("--freeze-at", type=int, default=4)
    ap.add_argument("--interval", type=int, default=8)
    ap.add_argument(
        "--layers-only", action="store_true", help="leave the embedding training (frozen layers then still backward)"
    )
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/dynmo_cpu"))
    ap.add_argument("--note", default="", help="free text for the results file (e.g. the machine's load)")
    args = ap.parse_args()
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    with tempfile.TemporaryDirectory() as tmp:
        runs = {p: run(p, args, Path(tmp) / f"{p}.json") for p in ("static", "dynmo")}
    s = summary(runs["static"], runs["dynmo"], args.freeze_at)
    meta = {
        "command": "python benchmarks/dynmo_cpu.py " + " ".join(sys.argv[1:]),
        "date": started,
        "machine": f"{os.cpu_count()} CPUs; {platform.platform()}; Python {platform.python_version()}",
        "note": args.note,
    }
    Path(args.out + ".json").write_text(json.dumps({"meta": meta, "summary": s, "runs": runs}, indent=2) + "\n")
    Path(args.out + ".md").write_text(markdown(meta, runs, s))
    print(json.dumps(s, indent=2))


if __name__ == "__main__":
    main()
