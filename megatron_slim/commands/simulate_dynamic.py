"""``megatron-slim simulate --dynamic SCHEME [--rebalance POLICIES]``: a dynamic model's training,
phase by phase, under Megatron's static split and under DynMo-style rebalancing (plan/dynmo)."""

from __future__ import annotations

from megatron_slim.commands.output import emit_json, prepare_outputs
from megatron_slim.plan.cost.calibration import Calibration
from megatron_slim.plan.dynmo.study import REBALANCE, Study, run_study, speedup
from megatron_slim.plan.recipe import Recipe
from megatron_slim.plan.schema import ConfigError


def parse_policies(text: str | None) -> tuple[str, ...]:
    """The policies to run; ``static`` (the reference every speedup divides) always first."""
    names = [n.strip() for n in (text or ",".join(REBALANCE)).split(",")]
    unknown = [n for n in names if n not in REBALANCE]
    if unknown or not all(names):
        raise ConfigError(f"--rebalance {text!r}: allowed: a comma list of {', '.join(REBALANCE)}")
    return ("static", *dict.fromkeys(n for n in names if n != "static"))


def check_flags(args) -> None:
    given = [("--compare", args.compare), ("--trace", args.trace), ("--plot", args.plot)]
    given += [("--cp-engine", args.cp_engine), ("--lengths", args.lengths)]
    for flag, value in given:
        if value:
            raise ConfigError(f"{flag}: not available with --dynamic (allowed with it: --rebalance, --phases, --json)")
    if args.phases is not None and args.phases < 1:
        raise ConfigError(f"--phases {args.phases}: allowed: an integer >= 1")


def run(args, recipe: Recipe, calibration: Calibration | None, note: str | None = None) -> int:
    check_flags(args)
    policies = parse_policies(args.rebalance)
    prepare_outputs(("--json", args.json))
    phases, seed = args.phases or 8, args.seed or 0
    studies = {p: run_study(recipe, args.dynamic, p, phases, seed, calibration) for p in policies}
    ratios = {p: speedup(studies["static"], s) for p, s in studies.items() if p != "static"}
    payload = {
        "recipe": recipe.name,
        "hardware": recipe.hardware,
        "calibration": args.calibration,
        "dynamic": {
            "scheme": args.dynamic,
            "phases": phases,
            "steps_per_phase": studies["static"].steps_per_phase,
            "policies": {p: _study_json(s) for p, s in studies.items()},
            "speedups": ratios,
            "speedup": ratios.get("dynmo"),
        },
    }
    out = emit_json(payload, args.json)
    if note:
        print(note, file=out)
    p = recipe.parallel
    print(
        f"recipe {recipe.name} on {recipe.hardware}: --dynamic {args.dynamic}, {recipe.schedule.kind} pp{p.pp} "
        f"(tp{p.tp} cp{p.cp} dp{p.dp}), {phases} phases of {studies['static'].steps_per_phase:g} steps",
        file=out,
    )
    print(table(studies), file=out)
    print("  ".join(f"{p}: {r:.2f}x over static" for p, r in ratios.items()), file=out)
    if args.json and args.json != "-":
        print(f"wrote {args.json}", file=out)
    return 0


def _study_json(study: Study) -> dict:
    return {
        "total_s": study.total_s,
        "phases": [
            {
                "progress": ph.progress,
                "layers_per_stage": list(ph.layers_per_stage),
                "iteration_time_s": ph.iteration_time_s,
                "peak_memory_bytes": int(ph.peak_memory_bytes),
                "moved_layers": ph.moved_layers,
                "migration_s": ph.migration_s,
            }
            for ph in study.phases
        ],
    }


def table(studies: dict[str, Study]) -> str:
    header = ["phase"] + [f"{p} split / iter s" for p in studies]
    rows = []
    for k, progress in enumerate(ph.progress for ph in studies["static"].phases):
        cells = [f"{k + 1} ({100 * progress:.0f}%)"]
        for s in studies.values():
            ph = s.phases[k]
            moved = f" +{ph.moved_layers} moved" if ph.moved_layers else ""
            cells.append(f"{'-'.join(map(str, ph.layers_per_stage))} / {ph.iteration_time_s:.3f}{moved}")
        rows.append(cells)
    rows.append(["total s"] + [f"{s.total_s:.1f}" for s in studies.values()])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
