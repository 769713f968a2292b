"""``megatron-slim simulate --packing METHODS --lengths FILE|SPEC``: packers timed by the pipeline
simulator (``plan/pack/simulate.py``).

    megatron-slim simulate --recipe llama2-7b-64k --packing slimpack,megatron,bfd \\
        --lengths 'mix:0.9*lognormal(mean=4096,sigma=1,min=64,max=65536)+0.1*lognormal(...)' \\
        [--micropack-tokens N] [--seed S] [--json PATH]

One global batch -- lengths drawn until they hold ``train.global_batch_size * model.seq_length``
tokens, the last cut to fit -- goes to every method, each under the same MicroPack token cap
(``--micropack-tokens``, default ``model.seq_length``), over the recipe's ``parallel.dp`` ranks.
With ``parallel.cp > 1`` SlimPack routes each outlier over DP (DP-merge) or over the replica's CP
group (Zeppelin), whichever is cheaper; the counts go to ``packing.slimpack.outlier_routes``.
"""

from __future__ import annotations

from megatron_slim.commands.output import emit_json, format_table, prepare_outputs
from megatron_slim.commands.progress import ProgressLine
from megatron_slim.plan.cost.calibration import Calibration
from megatron_slim.plan.cost.model import CostModel
from megatron_slim.plan.cp.lengths import SPEC_FORMS, parse_lengths
from megatron_slim.plan.pack.baselines import BASELINES, plan_baseline
from megatron_slim.plan.pack.costs import fit_slice_costs
from megatron_slim.plan.pack.cp_route import CPRoute
from megatron_slim.plan.pack.evaluate import draw_global_batch
from megatron_slim.plan.pack.plan import PackingPlan
from megatron_slim.plan.pack.simulate import PackedSimulation, simulate_plan
from megatron_slim.plan.pack.slimpack import solve
from megatron_slim.plan.recipe import Recipe
from megatron_slim.plan.schema import ConfigError

METHODS = ("slimpack", *BASELINES)
_GIB = 2**30


def parse_methods(text: str) -> tuple[str, ...]:
    names = [n.strip() for n in text.split(",")]
    if names == ["all"]:
        return METHODS
    unknown = [n for n in names if n not in METHODS]
    if unknown or not all(names):
        raise ConfigError(f"--packing {text!r}: allowed: 'all' or a comma list of {', '.join(METHODS)}")
    return tuple(dict.fromkeys(names))


def check_flags(args) -> None:
    """Flags that do not apply to packing, refused before any work."""
    given = [("--cp-engine", args.cp_engine), ("--dynamic", args.dynamic), ("--compare", args.compare)]
    given += [("--trace", args.trace), ("--plot", args.plot), ("--rebalance", args.rebalance)]
    given += [("--phases", args.phases)]
    for flag, value in given:
        if value is not None:
            raise ConfigError(
                f"{flag}: not available with --packing (allowed with it: --lengths, --micropack-tokens, "
                "--seed, --json, --calibration, --set)"
            )
    if not args.lengths:
        raise ConfigError(f"--lengths: required with --packing (allowed: {' | '.join(SPEC_FORMS)})")
    if args.micropack_tokens is not None and args.micropack_tokens < 1:
        raise ConfigError(f"--micropack-tokens {args.micropack_tokens}: allowed: an integer >= 1")


def make_plan(method: str, lengths: tuple[int, ...], cost: CostModel, cap: int) -> PackingPlan:
    """``method``'s plan; SlimPack's outliers may take the CP route when ``parallel.cp > 1``."""
    costs = fit_slice_costs(cost, cap, max(lengths))
    dp = cost.recipe.parallel.dp
    if method == "slimpack":
        cp_route = CPRoute.from_cost_model(cost, cap) if cost.recipe.parallel.cp > 1 else None
        return solve(lengths, costs, dp, cap, cp_route=cp_route).plan
    return plan_baseline(method, lengths, costs, dp, cap)


def table(results: list[PackedSimulation]) -> str:
    ref = next((r for r in results if r.method == "megatron"), None)
    header = ["packing", "iter s", "tokens/s", "vs megatron", "MFU", "padding", "fwd imb", "bwd imb", "peak GiB"]
    rows = []
    for r in results:
        fits = "" if r.peak_memory_bytes <= r.hbm_bytes else " OOM"
        rows.append(
            [
                r.method,
                f"{r.iteration_time_s:.3f}",
                f"{r.tokens_per_s:,.0f}",
                f"{ref.iteration_time_s / r.iteration_time_s:.2f}x" if ref else "-",
                f"{100 * r.mfu:.1f}%",
                f"{100 * r.padding_share:.0f}%",
                f"{r.fwd_imbalance:.3f}",
                f"{r.bwd_imbalance:.3f}",
                f"{r.peak_memory_bytes / _GIB:.1f}{fits}",
            ]
        )
    return format_table(header, rows)


def run(args, recipe: Recipe, calibration: Calibration | None, note: str | None = None) -> int:
    check_flags(args)
    methods = parse_methods(args.packing)
    source = parse_lengths(args.lengths)
    cap = args.micropack_tokens or recipe.model.seq_length
    seed = 0 if args.seed is None else args.seed
    prepare_outputs(("--json", args.json))
    cost = CostModel(recipe, calibration=calibration)
    lengths = draw_global_batch(source, recipe.train.global_batch_size * recipe.model.seq_length, seed)
    results = []
    with ProgressLine("megatron-slim simulate") as line:
        for i, method in enumerate(methods):
            line.update(f"packing {method} ({i + 1}/{len(methods)})", i, len(methods))
            results.append(simulate_plan(make_plan(method, lengths, cost, cap), cost))
    p = recipe.parallel
    payload = {
        "recipe": recipe.name,
        "hardware": recipe.hardware,
        "calibration": args.calibration,
        "lengths": args.lengths,
        "seed": seed,
        "micropack_tokens": cap,
        "samples": len(lengths),
        "tokens": sum(lengths),
        "packing": {r.method: r.to_json() for r in results},
    }
    out = emit_json(payload, args.json)
    if note:
        print(note, file=out)
    print(
        f"recipe {recipe.name} on {recipe.hardware}: {recipe.schedule.kind} tp{p.tp} pp{p.pp} cp{p.cp} dp{p.dp}; "
        f"{len(lengths)} samples, {sum(lengths):,} tokens (longest {max(lengths):,}) from {args.lengths} "
        f"(seed {seed}); MicroPacks of at most {cap:,} tokens",
        file=out,
    )
    print(table(results), file=out)
    for r in results:
        if r.outlier_routes:
            counts = ", ".join(f"{n} {route}" for route, n in r.outlier_routes)
            print(f"{r.method} outliers by route: {counts} (cp: split over the CP group by Zeppelin)", file=out)
    if args.json and args.json != "-":
        print(f"wrote {args.json}", file=out)
    return 0
