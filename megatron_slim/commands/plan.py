"""``megatron-slim plan``: the fastest configuration that fits, for SlimPipe and for the best
Megatron-LM baseline (1F1B or interleaved), side by side."""

from __future__ import annotations

import time

from megatron_slim.commands.calibration_arg import calibration_for
from megatron_slim.commands.output import emit_json, format_table, prepare_outputs
from megatron_slim.commands.progress import ProgressLine
from megatron_slim.plan.recipe import load_recipe
from megatron_slim.plan.tune import tune
from megatron_slim.plan.tune.report import payload, table_rows
from megatron_slim.plan.tune.tuner import nothing_fits

_GIB = 2**30


def main(args) -> int:
    recipe = load_recipe(args.recipe, args.set)
    gpus = args.gpus if args.gpus is not None else recipe.parallel.world_size
    calibration = calibration_for(args.calibration, recipe)
    prepare_outputs(("--json", args.json))
    start = time.perf_counter()
    with ProgressLine("megatron-slim plan") as line:

        def progress(phase: str, done: int, total: int) -> None:
            line.update(f"{phase} {done}/{total}", done, total, series=phase)

        result = tune(recipe, gpus, max_simulations=args.max_simulations, calibration=calibration, progress=progress)
    seconds = time.perf_counter() - start
    out = emit_json(payload(result, seconds, calibration.source if calibration else None), args.json)
    cap = next(iter(result.families.values())).cap_bytes
    print(
        f"recipe {recipe.name} on {gpus} x {recipe.hardware} ({cap / _GIB:.1f} GiB usable each): "
        f"{recipe.train.global_batch_size} sequences of {recipe.model.seq_length} tokens per step",
        file=out,
    )
    if calibration is not None:
        print(f"kernel rates: {args.calibration} ({calibration.source})", file=out)
    print(format_table(*table_rows(result)), file=out)
    for name, family in result.families.items():
        if family.best is None:
            print(nothing_fits(name, family), file=out)
    if result.speedup is not None:
        print(f"speedup (SlimPipe MFU / Megatron MFU): {result.speedup:.2f}x", file=out)
    print(f"searched in {seconds:.1f} s", file=out)
    if args.json and args.json != "-":
        print(f"wrote {args.json}", file=out)
    return 0
