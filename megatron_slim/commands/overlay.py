"""``megatron-slim overlay``: a traced iteration of ``megatron-slim train --profile DIR`` beside the
simulation of the same recipe and schedule: a table of busy time per pipeline rank, optionally
JSON and a PNG of both timelines."""

from __future__ import annotations

from megatron_slim.commands.calibration_arg import calibration_for
from megatron_slim.commands.output import emit_json, format_table, prepare_outputs
from megatron_slim.plan.recipe import load_recipe
from megatron_slim.plan.schema import ConfigError
from megatron_slim.plan.sim.measured import check_same_recipe, read_measured
from megatron_slim.plan.sim.overlay import compare_ranks


def table(rows, measured, simulated) -> str:
    """Busy time (forward and backward actions) per pipeline rank, then the pipeline's span."""
    body = [
        (
            f"rank {r.rank} busy",
            ",".join(map(str, r.stages)),
            f"{r.measured_busy_s:.4f}",
            f"{r.simulated_busy_s:.4f}",
            f"{r.ratio:.2f}",
        )
        for r in rows
    ]
    body.append(
        (
            "pipeline time",
            "all",
            f"{measured.pipeline_time_s:.4f}",
            f"{simulated.pipeline_time_s:.4f}",
            f"{measured.pipeline_time_s / simulated.pipeline_time_s:.2f}",
        )
    )
    return format_table(("", "stages", "measured s", "simulated s", "measured/simulated"), body)


def payload(recipe, measured, simulated, rows) -> dict:
    return {
        "recipe": recipe.name,
        "hardware": recipe.hardware,
        "iteration": measured.iteration,
        "run_id": measured.run_id,
        "schedule_digest": measured.schedule_digest,
        "measured": {"pipeline_time_s": measured.pipeline_time_s, "bubble_ratio": measured.bubble_ratio},
        "simulated": {"pipeline_time_s": simulated.pipeline_time_s, "bubble_ratio": simulated.bubble_ratio},
        "ranks": [
            {
                "rank": r.rank,
                "stages": list(r.stages),
                "measured_busy_s": r.measured_busy_s,
                "simulated_busy_s": r.simulated_busy_s,
            }
            for r in rows
        ],
    }


def main(args) -> int:
    """Traces, recipe, calibration and outputs are all checked before the simulation."""
    from megatron_slim.commands.simulate import run_one

    recipe = load_recipe(args.recipe, args.set)
    calibration = calibration_for(args.calibration, recipe)
    measured = read_measured(args.measured)
    check_same_recipe(measured, recipe.to_dict())
    prepare_outputs(("--json", args.json), ("--plot", args.plot))
    simulated = run_one(recipe, calibration).result
    if simulated.schedule.digest() != measured.schedule_digest:
        raise ConfigError(
            f"--measured: the traced run's schedule (digest {measured.schedule_digest}) is not the one "
            f"simulated for recipe {recipe.name} ({simulated.schedule.digest()}); allowed: traces "
            "written by this megatron-slim version for this recipe"
        )
    rows = compare_ranks(measured, simulated)
    out = emit_json(payload(recipe, measured, simulated, rows), args.json)
    print(
        f"recipe {recipe.name}: iteration {measured.iteration} measured (run {measured.run_id}) against "
        f"the simulation on {recipe.hardware}, schedule {simulated.schedule.kind}",
        file=out,
    )
    print(table(rows, measured, simulated), file=out)
    if args.json and args.json != "-":
        print(f"wrote {args.json}", file=out)
    if args.plot:
        from megatron_slim.plan.sim.overlay import plot_overlay

        plot_overlay(measured, simulated, recipe.hardware, args.plot)
        print(f"wrote plot {args.plot}", file=out)
    return 0
