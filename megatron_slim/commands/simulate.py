"""``megatron-slim simulate``: simulate a recipe's pipeline schedule(s) before spending cluster time."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_slim.commands.calibration_arg import calibration_for
from megatron_slim.commands.output import emit_json, format_table, prepare_outputs
from megatron_slim.commands.progress import ProgressLine
from megatron_slim.plan.cost.calibration import Calibration
from megatron_slim.plan.cost.model import CostModel
from megatron_slim.plan.progress import Progress
from megatron_slim.plan.recipe import Recipe, load_recipe
from megatron_slim.plan.recipe_note import world_size_note
from megatron_slim.plan.schedule.generators import generate
from megatron_slim.plan.schema import ConfigError
from megatron_slim.plan.sim.costs import RecipeCosts
from megatron_slim.plan.sim.engine import SimResult
from megatron_slim.plan.sim.exchange_timing import simulate_as_planned
from megatron_slim.plan.variants import schedule_variant

_GIB = 2**30


@dataclass
class Simulated:
    recipe: Recipe
    costs: RecipeCosts
    result: SimResult

    @property
    def label(self) -> str:
        return schedule_label(self.recipe)

    def to_json(self) -> dict:
        out: dict[str, Any] = {"recipe": self.recipe.name, "hardware": self.recipe.hardware, "label": self.label}
        out.update(self.result.to_json())
        out["slice_policy"] = self.recipe.schedule.slice_policy
        out["vocab_parallel"] = self.recipe.schedule.vocab_parallel
        out["slice_lengths"] = list(self.costs.lengths)
        return out


def schedule_label(recipe: Recipe) -> str:
    s, p = recipe.schedule, recipe.parallel
    extra = f" v{p.vpp}" if p.vpp > 1 else ""
    vocab = " vocab-pp" if s.vocab_parallel and p.pp > 1 else ""
    return f"{s.kind}{extra}" + (f" n{s.num_slices} {s.slice_policy}" if s.kind == "slimpipe" else "") + vocab


def run_one(recipe: Recipe, calibration: Calibration | None = None, progress: Progress | None = None) -> Simulated:
    costs = RecipeCosts(recipe, CostModel(recipe, calibration=calibration))
    p = recipe.parallel
    schedule = generate(recipe.schedule.kind, p.pp, p.vpp, recipe.num_microbatches, recipe.schedule.num_slices)
    return Simulated(recipe, costs, simulate_as_planned(schedule, costs, progress))


def schedule_progress(line: ProgressLine, recipe: Recipe, index: int, count: int) -> Progress:
    """The simulator's ``(phase, done, total)`` as a line: schedule, phase, actions."""
    label = f"{schedule_label(recipe)} ({index + 1}/{count})" if count > 1 else schedule_label(recipe)

    def progress(phase: str, done: int, total: int) -> None:
        line.update(f"{label}: {phase} {done:,}/{total:,} actions", done, total, series=(index, phase))

    return progress


def table(runs: list[Simulated]) -> str:
    header = ("schedule", "iter s", "bubble", "MFU", "peak GiB", "act GiB", "K/V GiB", "static GiB", "fits")
    rows = []
    for run in runs:
        res = run.result
        worst = max(res.ranks, key=lambda r: r.peak_memory_bytes)
        rows.append(
            (
                run.label,
                f"{res.iteration_time_s:.3f}",
                f"{100 * res.bubble_ratio:.1f}%",
                f"{100 * res.mfu:.1f}%",
                f"{worst.peak_memory_bytes / _GIB:.1f} (r{worst.rank})",
                f"{worst.peak_activation_bytes / _GIB:.1f}",
                f"{worst.peak_kv_bytes / _GIB:.2f}",
                f"{worst.static_bytes / _GIB:.1f}",
                "yes" if worst.peak_memory_bytes <= res.hbm_bytes else "NO (OOM)",
            )
        )
    return format_table(header, rows)


def output_flags(args) -> tuple[tuple[str, str | None], ...]:
    return ("--json", args.json), ("--trace", args.trace), ("--plot", args.plot)


def _refuse_dynamic_only_flags(args) -> None:
    for flag, value in (("--rebalance", getattr(args, "rebalance", None)), ("--phases", getattr(args, "phases", None))):
        if value is not None:
            raise ConfigError(f"{flag}: only with --dynamic SCHEME (allowed: add --dynamic, or drop {flag})")


def _other_study(args, recipe: Recipe, calibration: Calibration | None, note: str | None) -> int | None:
    """Run the study a mode flag asks for (packing, dynamic model, CP engines); ``None``: none did."""
    if getattr(args, "packing", None) is not None:
        from megatron_slim.commands import simulate_pack

        return simulate_pack.run(args, recipe, calibration, note)
    if getattr(args, "micropack_tokens", None) is not None:
        raise ConfigError("--micropack-tokens: only with --packing METHODS (allowed: add --packing, or drop it)")
    if getattr(args, "dynamic", None):
        from megatron_slim.commands import simulate_dynamic

        return simulate_dynamic.run(args, recipe, calibration, note)
    _refuse_dynamic_only_flags(args)
    if getattr(args, "cp_engine", None) or getattr(args, "lengths", None):
        from megatron_slim.commands import simulate_cp

        return simulate_cp.run(args, recipe, calibration, note)
    if args.seed is not None:
        raise ConfigError(
            f"--seed {args.seed}: it seeds the sequence lengths drawn for --lengths, and a pipeline "
            "simulation draws none (allowed: --seed with --lengths/--cp-engine, or no --seed)"
        )
    return None


def main(args) -> int:
    """Every input is read and checked (recipe, overrides, calibration, schedules, output paths)
    before the first simulation."""
    recipe = load_recipe(args.recipe, args.set)
    calibration = calibration_for(args.calibration, recipe)
    note = world_size_note(args.recipe, args.set, recipe)
    status = _other_study(args, recipe, calibration, note)
    if status is not None:
        return status
    kinds = [k.strip() for k in (args.compare or "").split(",")]
    if args.compare is not None and not all(kinds):
        raise ConfigError(
            f"--compare {args.compare!r}: an empty schedule name (allowed: a comma list of "
            "1f1b, interleaved, slimpipe with nothing empty, e.g. 1f1b,slimpipe)"
        )
    kinds = kinds if args.compare is not None else []
    variants = [schedule_variant(recipe, k) for k in kinds] if kinds else [recipe]
    prepare_outputs(*output_flags(args))
    with ProgressLine("megatron-slim simulate") as line:
        runs = [run_one(v, calibration, schedule_progress(line, v, i, len(variants))) for i, v in enumerate(variants)]
    payload = (
        runs[0].to_json()
        if not kinds
        else {"recipe": recipe.name, "hardware": recipe.hardware, "results": [r.to_json() for r in runs]}
    )
    payload["calibration"] = args.calibration
    out = emit_json(payload, args.json)
    if note:
        print(note, file=out)
    print(
        f"recipe {recipe.name} on {recipe.hardware}: {recipe.parallel.world_size} GPUs "
        f"(tp{recipe.parallel.tp} pp{recipe.parallel.pp} cp{recipe.parallel.cp} dp{recipe.parallel.dp}), "
        f"{recipe.num_microbatches} microbatches of {recipe.model.seq_length} tokens",
        file=out,
    )
    print(table(runs), file=out)
    if args.json and args.json != "-":
        print(f"wrote {args.json}", file=out)
    if args.trace:
        from megatron_slim.plan.sim.trace import write_chrome_trace_many

        write_chrome_trace_many([(r.label, r.result) for r in runs], args.trace)
        print(f"wrote trace {args.trace} (open in https://ui.perfetto.dev)", file=out)
    if args.plot:
        from megatron_slim.plan.sim.plot import plot_results

        plot_results([(r.label, r.result) for r in runs], args.plot)
        print(f"wrote plot {args.plot}", file=out)
    return 0
