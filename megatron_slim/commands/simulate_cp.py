"""``megatron-slim simulate --cp-engine ...``: context-parallel engines on variable-length packs.

    megatron-slim simulate --recipe zeppelin-7b-h800 --cp-engine all \\
        --lengths lognormal:mean=8192,sigma=1.1,min=1024,max=65536 --seed 0 \\
        [--json out/cp.json] [--trace out/cp.trace.json] [--plot out/cp.png] [--calibration FILE]

The batch (``train.global_batch_size`` packs of ``model.seq_length`` tokens) is drawn once and
every engine runs the same packs. Without ``--cp-engine`` the recipe's ``cp.engine`` is used.
``--trace``: per rank, compute and each link's transfers of one decoder layer per pack
(``plan/sim/cp/trace.py``); ``--plot``: per engine and per rank, attention / linear / idle time
(``plan/sim/cp/plot.py``); ``--calibration``: measured kernel rates, as for pipeline simulation.
"""

from __future__ import annotations

from typing import TextIO

from megatron_slim.commands.output import emit_json, format_table, prepare_outputs
from megatron_slim.commands.progress import ProgressLine
from megatron_slim.plan.cost.calibration import Calibration
from megatron_slim.plan.cp.engines import check_supported, megatron_cp_refusal, parse_engines
from megatron_slim.plan.cp.lengths import SPEC_FORMS, make_packs, parse_lengths
from megatron_slim.plan.progress import Progress
from megatron_slim.plan.recipe import MEGATRON_CP_ENGINE, Recipe
from megatron_slim.plan.schema import ConfigError
from megatron_slim.plan.sim.cp.sim import CPSimResult, cp_setup, simulate_cp


def check_inputs(recipe: Recipe, engines: tuple[str, ...], lengths: str, calibration: Calibration | None):
    """Everything a CP simulation reads, checked: the lengths source, the recipe's CP domain, each
    engine on it."""
    source = parse_lengths(lengths)
    topo, costs = cp_setup(recipe, calibration)
    for engine in engines:
        check_supported(engine, topo, costs)
    return source, topo, costs


def table(results: list[CPSimResult]) -> str:
    ring = next((r for r in results if r.engine == "ring"), None)
    header = ["engine", "iter s", "tokens/s", "MFU", "vs ring", "busiest rank busy", "idle (avg)", "inter-node GB/rank"]
    rows = []
    for res in results:
        n = len(res.ranks)
        busy = max(r.attention_s + r.linear_s for r in res.ranks)
        idle = sum(r.idle_s for r in res.ranks) / n
        inter = sum(r.inter_node_bytes for r in res.ranks) / n / 1e9
        speed = f"{ring.iteration_time_s / res.iteration_time_s:.2f}x" if ring else "-"
        rows.append(
            [
                res.engine + (" +remap" if res.remap else ""),
                f"{res.iteration_time_s:.3f}",
                f"{res.tokens_per_s:,.0f}",
                f"{100 * res.mfu:.1f}%",
                speed,
                f"{busy:.3f} s",
                f"{100 * idle / res.iteration_time_s:.0f}%",
                f"{inter:.1f}",
            ]
        )
    return format_table(header, rows)


def engine_progress(line: ProgressLine, engines: tuple[str, ...], index: int) -> Progress:
    """The simulator's per-pack calls as a line: engine, packs planned and simulated; the ETA runs
    over every engine's packs."""

    def progress(_phase: str, done: int, total: int) -> None:
        line.update(
            f"engine {engines[index]} ({index + 1}/{len(engines)}): {done}/{total} packs planned and simulated",
            index * total + done,
            len(engines) * total,
        )

    return progress


def run(args, recipe: Recipe, calibration: Calibration | None, note: str | None = None) -> int:
    """``simulate`` with ``--cp-engine``/``--lengths``: ``recipe`` and ``calibration`` are already
    loaded; every other input is checked here before the first pack is simulated."""
    if getattr(args, "compare", None):
        raise ConfigError(
            "--compare: pipeline schedules cannot be combined with --cp-engine/--lengths (allowed: one of them)"
        )
    if not args.lengths:
        raise ConfigError(f"--lengths: required with --cp-engine (allowed: {' | '.join(SPEC_FORMS)})")
    if not args.cp_engine and recipe.cp.engine == MEGATRON_CP_ENGINE:
        raise megatron_cp_refusal("cp.engine")
    engines = parse_engines(args.cp_engine) if args.cp_engine else (recipe.cp.engine,)
    seed = 0 if args.seed is None else args.seed
    source, topo, costs = check_inputs(recipe, engines, args.lengths, calibration)
    prepare_outputs(("--json", args.json), ("--trace", args.trace), ("--plot", args.plot))
    packs = make_packs(source, recipe.model.seq_length, recipe.num_microbatches, seed)
    with ProgressLine("megatron-slim simulate") as line:
        results = [
            simulate_cp(
                recipe,
                e,
                packs,
                topo=topo,
                costs=costs,
                record=bool(args.trace),
                progress=engine_progress(line, engines, i),
            )
            for i, e in enumerate(engines)
        ]
    payload: dict = {
        "recipe": recipe.name,
        "hardware": recipe.hardware,
        "lengths": args.lengths,
        "seed": seed,
        "calibration": args.calibration,
        "pack_lengths": [list(p) for p in packs],
    }
    if len(results) == 1:
        payload.update(results[0].to_json())
    else:
        payload["results"] = [r.to_json() for r in results]
    out = emit_json(payload, args.json, indent=1)
    p = recipe.parallel
    seqs = sum(len(pk) for pk in packs)
    if note:
        print(note, file=out)
    print(
        f"recipe {recipe.name} on {recipe.hardware}: cp={p.cp} (tp{p.tp}), {len(packs)} packs of "
        f"{recipe.model.seq_length} tokens, {seqs} sequences from {args.lengths} (seed {seed})",
        file=out,
    )
    print(table(results), file=out)
    for res in (r for r in results if r.engine == "zeppelin"):
        print(picks_line(res), file=out)
    _write_files(args, results, out)
    return 0


def picks_line(res: CPSimResult) -> str:
    """``zeppelin kept per pack: zeppelin 7, a2a+p2p 8, ulysses 1`` (``CPPlan.picked``, most first)."""
    counts: dict[str, int] = {}
    for pack in res.packs:
        counts[pack.plan["picked"]] = counts.get(pack.plan["picked"], 0) + 1
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return "zeppelin kept per pack: " + ", ".join(f"{name} {n}" for name, n in ranked)


def _write_files(args, results: list, out: TextIO) -> None:
    """The trace and plot files asked for, and a line naming each file written."""
    if args.json and args.json != "-":
        print(f"wrote {args.json}", file=out)
    if args.trace:
        from megatron_slim.plan.sim.cp.trace import write_cp_trace

        write_cp_trace(results, args.trace)
        print(f"wrote trace {args.trace} (one decoder layer per pack; open in https://ui.perfetto.dev)", file=out)
    if args.plot:
        from megatron_slim.plan.sim.cp.plot import plot_cp_results

        plot_cp_results(results, args.plot)
        print(f"wrote plot {args.plot}", file=out)
