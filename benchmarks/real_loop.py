#!/usr/bin/env python
"""Megatron-LM's real ``pretrain()`` on CPU gloo ranks, side by side: Megatron's own 1F1B and
interleaved 1F1B against SlimPipe, same model, same data, one invocation.

    python benchmarks/real_loop.py [--iters 5] [--lr 0.003] [--quick] [--only NAME ...]
    python benchmarks/real_loop.py --render   # rewrite the .md from the .json (keeps the interpretation)

Every schedule runs ``torchrun --standalone --nproc_per_node 4 [-m megatron_slim.launch]
<Megatron-LM tag>/pretrain_gpt.py $(megatron-slim megatron-args ...)`` through the contract tier's
harness (``tests/real_megatron/harness.py``: CPU shim, exact per-iteration metrics) with
``MEGATRON_SLIM_BENCH_ACTIVATIONS=1``, which makes every rank count the bytes autograd holds saved
for backward the same way whichever schedule runs (``tests/real_megatron/shim/activation_recorder.py``
says precisely what is counted). Reported per schedule:

* seconds per iteration: median over the iterations after the first of the differences between
  the last pipeline rank's consecutive ``training_log`` timestamps (Megatron's own printed
  ``elapsed time per iteration`` alongside, as a cross-check);
* peak activation bytes per pipeline rank (max over iterations), and the same without square
  ``seq x seq`` attention matrices (which only Megatron's unfused CPU attention saves);
* ratios against Megatron's 1F1B of the same invocation;
* relative differences of lm loss and grad norm against the corresponding Megatron run (SlimPipe
  vpp=1 against 1F1B, SlimPipe vpp=2 against interleaved): the lm loss of every iteration and the
  first iteration's grad norm must agree to 1e-5 (exit status 1 otherwise, after writing).

Writes ``benchmarks/results/real_loop.{md,json}`` (``--out PREFIX`` to change). A benchmark, not a
test: it asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.real_megatron.harness import megatron_args, relative_difference, run_pretrain, write_corpus  # noqa: E402

MIB = 2**20
LOSS_TOLERANCE = 1e-5

MODEL = {
    "num_layers": 8,
    "hidden_size": 256,
    "ffn_hidden_size": 704,
    "num_attention_heads": 8,
    "num_query_groups": 2,
    "vocab_size": 1024,
    "seq_length": 2048,
}
QUICK = {
    "num_layers": 8,
    "hidden_size": 64,
    "ffn_hidden_size": 176,
    "num_attention_heads": 4,
    "num_query_groups": 2,
    "vocab_size": 256,
    "seq_length": 256,
}


@dataclass(frozen=True)
class Schedule:
    name: str
    label: str
    overrides: tuple[str, ...]
    slimpipe: bool  # through megatron_slim.launch
    reference: str | None = None  # the Megatron run its losses must match
    extra: tuple[str, ...] = ()


SCHEDULES = [
    Schedule(
        "megatron-1f1b", "Megatron 1F1B", ("parallel.vpp=1", "schedule.kind=1f1b", "schedule.num_slices=1"), False
    ),
    # Over gloo, Megatron's overlapped p2p of the interleaved schedule is matched nondeterministically
    # (see tests/real_megatron/test_training_contract.py); without the overlap it is deterministic.
    Schedule(
        "megatron-interleaved",
        "Megatron interleaved (vpp 2)",
        ("parallel.vpp=2", "schedule.kind=interleaved", "schedule.num_slices=1"),
        False,
        extra=("--no-overlap-p2p-communication",),
    ),
    Schedule(
        "slimpipe-n1",
        "SlimPipe n=1 (1F1B order, megatron-slim attention)",
        ("parallel.vpp=1", "schedule.kind=slimpipe", "schedule.num_slices=1"),
        True,
        "megatron-1f1b",
    ),
    Schedule(
        "slimpipe-n4",
        "SlimPipe n=4 uniform",
        ("parallel.vpp=1", "schedule.kind=slimpipe", "schedule.num_slices=4"),
        True,
        "megatron-1f1b",
    ),
    Schedule(
        "slimpipe-n8",
        "SlimPipe n=8 uniform",
        ("parallel.vpp=1", "schedule.kind=slimpipe", "schedule.num_slices=8"),
        True,
        "megatron-1f1b",
    ),
    Schedule(
        "slimpipe-vpp2-n4",
        "SlimPipe vpp 2, n=4 uniform",
        ("parallel.vpp=2", "schedule.kind=slimpipe", "schedule.num_slices=4"),
        True,
        "megatron-interleaved",
    ),
]


def _common(model: dict, iters: int, pp: int, microbatches: int, lr: float = 3e-3) -> list[str]:
    return [
        *(f"model.{k}={v}" for k, v in model.items()),
        f"train.iters={iters}",
        "train.warmup_iters=1",
        f"train.global_batch_size={microbatches}",
        "train.micro_batch_size=1",
        f"train.lr={lr}",
        f"train.min_lr={lr / 10}",
        "schedule.slice_policy=uniform",
        f"parallel.pp={pp}",
        "parallel.tp=1",
        "parallel.cp=1",
        "parallel.dp=1",
    ]


def _machine() -> dict:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch
    from megatron.core import package_info

    return {
        "nproc": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)),
        "cpu": cpu,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "megatron_core": package_info.__version__,
    }


def _megatron_elapsed_ms(log: str) -> list[float]:
    return [float(x) for x in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", log)]


def run_schedule(s: Schedule, common: list[str], nproc: int, corpus: Path, workdir: Path, timeout_s: int) -> dict:
    flags = megatron_args(common + list(s.overrides)) + list(s.extra)
    assert ("--use-slimpipe" in flags) == s.slimpipe, (s.name, flags)
    load_before = os.getloadavg()
    start = time.perf_counter()
    run = run_pretrain(
        nproc,
        flags,
        workdir / s.name,
        launcher=s.slimpipe,
        data_prefix=corpus,
        timeout_s=timeout_s,
        env={"MEGATRON_SLIM_BENCH_ACTIVATIONS": "1"},
        processes="torchrun",  # as users launch it (the wall time includes each rank's start-up)
    )
    wall = time.perf_counter() - start
    if s.slimpipe:
        assert "megatron-slim: SlimPipe schedule" in run.log, run.log[-3000:]
    else:
        assert "megatron-slim" not in run.log
    last = nproc - 1
    stamps = run.times[last]
    per_iter = [b - a for a, b in zip(stamps, stamps[1:])]  # iterations 2..N
    ranks = []
    for rank in range(nproc):
        records = run.activations[rank]
        ranks.append(
            {
                "rank": rank,
                "peak_bytes": max(r["peak_bytes"] for r in records),
                "peak_excl_sxs_bytes": max(r["peak_excl_sxs_bytes"] for r in records),
                "peak_sxs_bytes": max(r["peak_sxs_bytes"] for r in records),
                "peak_bytes_per_iteration": [r["peak_bytes"] for r in records],
                "live_bytes_after": [r["live_bytes_after"] for r in records],
                "saved_tensors_per_iteration": [r["saved_tensors"] for r in records],
                "thread": records[0].get("thread"),
            }
        )
    return {
        "name": s.name,
        "label": s.label,
        "flags": shlex.join(flags),
        "launcher": s.slimpipe,
        "reference": s.reference,
        "losses": run.losses,
        "grad_norms": run.grad_norms,
        "iteration_s": per_iter,
        "median_iteration_s": statistics.median(per_iter) if per_iter else None,
        "megatron_elapsed_ms": _megatron_elapsed_ms(run.log),
        "wall_s": wall,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "ranks": ranks,
    }


def simulated(s: Schedule, common: list[str]) -> list[dict]:
    """megatron-slim's simulator on the same recipe: per rank peak activation and K/V bytes (its
    memory model is megatron-slim's attention: q, k, v, out, lse saved, no seq x seq matrix)."""
    from megatron_slim.commands.simulate import run_one
    from megatron_slim.plan.recipe import load_recipe

    j = run_one(load_recipe("tiny-cpu", common + list(s.overrides))).to_json()
    return [
        {"rank": r["rank"], "peak_activation_bytes": r["peak_activation_bytes"], "peak_kv_bytes": r["peak_kv_bytes"]}
        for r in j["ranks"]
    ]


def _ratios(results: list[dict]) -> None:
    base = next((r for r in results if r["name"] == "megatron-1f1b"), None)
    by_name = {r["name"]: r for r in results}
    for r in results:
        ref = by_name.get(r["reference"]) if r["reference"] else None
        if ref is not None:
            r["loss_max_rel_diff"] = relative_difference(r["losses"], ref["losses"])
            r["grad_norm_max_rel_diff"] = relative_difference(r["grad_norms"], ref["grad_norms"])
            r["grad_norm_rel_diff_per_iteration"] = [
                relative_difference([a], [b]) for a, b in zip(r["grad_norms"], ref["grad_norms"])
            ]
            # The lm loss of every iteration, and the grad norm of the first (the gradient of the very
            # same weights on the same data), must agree to fp32 rounding. Later grad norms are
            # reported, not judged: they follow trajectories in which rounding differences between
            # kernels and summation orders compound through the optimizer, fastest across grad-norm
            # spikes (Megatron's own 1F1B vs SlimPipe n=1, the same order with another attention
            # kernel, shows the same growth).
            r["matches_reference"] = (
                r["loss_max_rel_diff"] <= LOSS_TOLERANCE and r["grad_norm_rel_diff_per_iteration"][0] <= LOSS_TOLERANCE
            )
        r["max_peak_bytes"] = max(x["peak_bytes"] for x in r["ranks"])
        r["max_peak_excl_sxs_bytes"] = max(x["peak_excl_sxs_bytes"] for x in r["ranks"])
        if base is None:
            continue
        r["time_ratio_vs_1f1b"] = r["median_iteration_s"] / base["median_iteration_s"]
        r["max_peak_ratio_vs_1f1b"] = r["max_peak_bytes"] / max(x["peak_bytes"] for x in base["ranks"])
        r["max_peak_excl_sxs_ratio_vs_1f1b"] = r["max_peak_excl_sxs_bytes"] / max(
            x["peak_excl_sxs_bytes"] for x in base["ranks"]
        )
        for x, b in zip(r["ranks"], base["ranks"]):
            x["peak_ratio_vs_1f1b"] = x["peak_bytes"] / b["peak_bytes"]
            x["peak_excl_sxs_ratio_vs_1f1b"] = x["peak_excl_sxs_bytes"] / b["peak_excl_sxs_bytes"]


def _fmt(x, spec=".2f", none="–"):
    return none if x is None else format(x, spec)


def write_markdown(report: dict, path: Path) -> None:
    results = report["results"]
    m = report["machine"]
    nproc = report["setup"]["nproc"]
    lines = [
        "# Megatron-LM's real training loop on CPU ranks: 1F1B / interleaved vs SlimPipe",
        "",
        "```",
        f"command: {report['command']}",
        f"date: {report['date']}",
        f"machine: {m['nproc']} CPUs ({m['affinity']} usable), {m['cpu']}; {m['platform']}; Python {m['python']}",
        f"torch {m['torch']}, megatron-core {m['megatron_core']}, Megatron-LM "
        f"{report['setup']['megatron_lm_tag']} (pretrain_gpt.py, unmodified)",
        f"load average (1/5/15 min) at start {report['loadavg_start']}, at end {report['loadavg_end']}",
        "```",
        "",
        f"Model: {report['setup']['model']}; fp32, micro-batch 1, {report['setup']['microbatches']} "
        f"microbatches per iteration, peak lr {report['setup']['lr']}, pp={report['setup']['pp']} on "
        f"{nproc} gloo ranks (one rank per stage; with vpp 2 a rank holds two chunks), "
        f"{report['setup']['iters']} iterations, `OMP_NUM_THREADS=1` per rank. Runs one after another in one "
        "invocation; same data "
        "(synthetic corpus in Megatron's indexed format), same seed.",
        "",
        "## Time and memory",
        "",
        "s/iter: median over iterations 2..N of the last rank's iteration wall time (Megatron's own "
        "printed figure in brackets). peak: max over ranks of the peak activation bytes (saved for "
        "backward, see below); w/o s×s: the same without square seq×seq attention matrices. Ratios are "
        "against Megatron 1F1B of this invocation. Diff: relative difference against the Megatron run of the "
        "same layout, of the lm loss (largest over iterations), of the first iteration's grad norm, and of "
        "the grad norm (largest over iterations; later iterations compound fp32 rounding through the "
        "optimizer, so only the first two are held to 1e-5). load: the machine's 1-minute "
        "load average before and after the schedule's run (other users share the 2 cores).",
        "",
        "| schedule | s/iter | ×1F1B | peak MiB | ×1F1B | w/o s×s MiB | ×1F1B "
        "| lm loss / grad norm it. 1 / grad norm max diff | load |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in results:
        meg = r["megatron_elapsed_ms"][1:]
        meg_s = f" ({statistics.median(meg) / 1000:.2f})" if meg else ""
        diff = (
            f"{r['loss_max_rel_diff']:.1e} / {r['grad_norm_rel_diff_per_iteration'][0]:.1e} / "
            f"{r['grad_norm_max_rel_diff']:.1e} vs {r['reference']}"
            if "loss_max_rel_diff" in r
            else "(reference)"
        )
        lines.append(
            f"| {r['label']} | {_fmt(r['median_iteration_s'])}{meg_s} | {_fmt(r.get('time_ratio_vs_1f1b'))} "
            f"| {r['max_peak_bytes'] / MIB:.1f} | {_fmt(r.get('max_peak_ratio_vs_1f1b'))} "
            f"| {r['max_peak_excl_sxs_bytes'] / MIB:.1f} | {_fmt(r.get('max_peak_excl_sxs_ratio_vs_1f1b'))} "
            f"| {diff} | {r['loadavg_before'][0]:.1f}→{r['loadavg_after'][0]:.1f} |"
        )
    lines += [
        "",
        "## Peak activation MiB per pipeline rank (×1F1B of the same rank)",
        "",
        "| schedule | "
        + " | ".join(f"rank {i}" for i in range(nproc))
        + " | "
        + " | ".join(f"rank {i} w/o s×s" for i in range(nproc))
        + " |",
        "|---|" + "---:|" * (2 * nproc),
    ]
    for r in results:
        cells = [f"{x['peak_bytes'] / MIB:.1f} ({_fmt(x.get('peak_ratio_vs_1f1b'))})" for x in r["ranks"]]
        cells += [
            f"{x['peak_excl_sxs_bytes'] / MIB:.1f} ({_fmt(x.get('peak_excl_sxs_ratio_vs_1f1b'))})" for x in r["ranks"]
        ]
        lines.append(f"| {r['label']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Cross-check: measured against megatron-slim's simulator (MiB per rank)",
        "",
        "The simulator's memory model is megatron-slim's attention (it saves q, k, v, out and the "
        "log-sum-exp; no seq×seq matrix), so for Megatron's own runs compare it with the w/o s×s "
        "figure. sim = simulated peak activation + simulated peak K/V (their peaks need not coincide, so "
        "this is an upper bound of the simulated peak of the sum).",
        "",
        "| schedule | " + " | ".join(f"rank {i} measured / w/o s×s / sim" for i in range(nproc)) + " |",
        "|---|" + "---:|" * nproc,
    ]
    for r in results:
        cells = [
            f"{x['peak_bytes'] / MIB:.1f} / {x['peak_excl_sxs_bytes'] / MIB:.1f} / "
            f"{(y['peak_activation_bytes'] + y['peak_kv_bytes']) / MIB:.1f}"
            for x, y in zip(r["ranks"], r.get("simulated_ranks") or [])
        ]
        lines.append(f"| {r['label']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## What is measured",
        "",
        report["measured"],
        "",
        "## Interpretation",
        "",
        report.get("interpretation", "(to be written)"),
        "",
    ]
    path.write_text("\n".join(lines))


MEASURED = """\
Peak activation bytes come from one process-wide `torch.autograd.graph.saved_tensors_hooks` pair,
entered on each rank's main thread (the one that runs every forward) when Megatron's `train()`
starts, and applied identically whichever schedule runs
(`tests/real_megatron/shim/activation_recorder.py`). It counts the bytes of every distinct
storage autograd holds saved for backward, once per storage, excluding the storages of model
parameters, from the moment it is first saved until the last saved-tensor slot referring to it is
released; the peak of that live sum is taken per iteration and rank. Included: every layer's
saved inputs and intermediates, the stage's received input, Megatron's attention score /
probability matrices (its local, unfused CPU attention saves them), the loss's saved logits, and
megatron-slim's K/V cache (each slice's K and V chunks are the very storages slice attention saves
for backward). Not included: tensors nobody saves for backward (sent stage outputs, kernel
workspaces), megatron-slim's transient fp32 dK/dV accumulators, gradients, optimizer state,
parameters, allocator overhead. `w/o s×s` is the peak of the same live sum without storages shaped
`[..., seq, seq]` (Megatron's attention matrices and its shared causal mask)."""


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--pp", type=int, default=4)
    p.add_argument(
        "--lr",
        type=float,
        default=3e-3,
        help="peak learning rate (too high a rate makes loss spikes that amplify fp32 rounding "
        "differences between schedules from iteration to iteration)",
    )
    p.add_argument("--quick", action="store_true", help="a small model, to check the driver (not a result)")
    p.add_argument("--only", nargs="*", default=None, help="schedule names to run (default: all)")
    p.add_argument(
        "--out",
        default=str(REPO / "benchmarks" / "results" / "real_loop"),
        help="output prefix: writes PREFIX.md and PREFIX.json",
    )
    p.add_argument("--timeout", type=int, default=1800, help="seconds per schedule")
    p.add_argument("--workdir", default=None, help="keep the runs' folders here (default: a temporary folder)")
    p.add_argument(
        "--render",
        action="store_true",
        help="run nothing: recompute ratios and verdicts from PREFIX.json and rewrite PREFIX.md",
    )
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.render:
        report = json.loads(out.with_suffix(".json").read_text())
        report["measured"] = MEASURED
        _finish(report, out, keep_interpretation=True)
        return

    from tests.real_megatron.harness import installed_tag

    model = QUICK if args.quick else MODEL
    common = _common(model, args.iters, args.pp, args.microbatches, args.lr)
    chosen = [s for s in SCHEDULES if args.only is None or s.name in args.only]
    report = {
        "command": "python " + shlex.join(["benchmarks/real_loop.py", *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": _machine(),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "setup": {
            "model": ", ".join(f"{k} {v}" for k, v in model.items()),
            "pp": args.pp,
            "lr": args.lr,
            "nproc": args.pp,
            "iters": args.iters,
            "microbatches": args.microbatches,
            "megatron_lm_tag": installed_tag().name,
            "quick": args.quick,
        },
        "measured": MEASURED,
        "results": [],
    }
    with tempfile.TemporaryDirectory(prefix="real_loop_") as tmp:
        workdir = Path(args.workdir) if args.workdir else Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        corpus = write_corpus(workdir / "corpus", documents=4000, vocab=model["vocab_size"])
        for s in chosen:
            print(f"[real_loop] {s.name} ...", flush=True)
            r = run_schedule(s, common, args.pp, corpus, workdir, args.timeout)
            r["simulated_ranks"] = simulated(s, common)
            report["results"].append(r)
            print(
                f"[real_loop] {s.name}: {_fmt(r['median_iteration_s'])} s/iter, peaks MiB "
                f"{[round(x['peak_bytes'] / MIB, 1) for x in r['ranks']]}, wall {r['wall_s']:.0f}s, "
                f"load {r['loadavg_after'][0]:.2f}",
                flush=True,
            )
    report["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    _finish(report, out, keep_interpretation=not args.quick)


def _finish(report: dict, out: Path, keep_interpretation: bool) -> None:
    _ratios(report["results"])
    out.parent.mkdir(parents=True, exist_ok=True)
    previous = out.with_suffix(".md")
    if previous.exists() and keep_interpretation:  # keep the hand-written interpretation
        text = previous.read_text().split("## Interpretation\n", 1)
        if len(text) == 2 and text[1].strip() and text[1].strip() != "(to be written)":
            report["interpretation"] = text[1].strip()
    out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    write_markdown(report, out.with_suffix(".md"))
    bad = [r["name"] for r in report["results"] if r.get("matches_reference") is False]
    print(f"[real_loop] wrote {out}.md and {out}.json" + (f"; DISAGREES WITH MEGATRON: {bad}" if bad else ""))
    if bad:
        sys.exit(1)


if __name__ == "__main__":
    main()
