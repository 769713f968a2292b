"""``megatron-slim simulate --cp-engine ...``: context-parallel engines on variable-length packs.

    megatron-slim simulate --recipe zeppelin-7b-h800 --cp-engine all \\
        --lengths lognormal:mean=8192,sigma=1.1,min=1024,max=65536 --seed 0 [--json out.json]

The batch (``train.global_batch_size`` packs of ``model.seq_length`` tokens) is drawn once and
every engine runs the same packs. Without ``--cp-engine`` the recipe's ``cp.engine`` is used.
"""
from __future__ import annotations


from megatron_slim.commands.output import emit_json, format_table
from megatron_slim.plan.cp.engines import check_supported, parse_engines
from megatron_slim.plan.cp.lengths import SPEC_FORMS, make_packs, parse_lengths
from megatron_slim.plan.recipe import Recipe, load_recipe
from megatron_slim.plan.schema import ConfigError
from megatron_slim.plan.sim.cp_sim import CPSimResult, cp_setup, simulate_cp


def run_engines(recipe: Recipe, engines: tuple[str, ...], lengths: str, seed: int) -> tuple[
        tuple[tuple[int, ...], ...], list[CPSimResult]]:
    source = parse_lengths(lengths)
    topo, costs = cp_setup(recipe)
    for engine in engines:
        check_supported(engine, topo, costs)
    packs = make_packs(source, recipe.model.seq_length, recipe.num_microbatches, seed)
    return packs, [simulate_cp(recipe, e, packs, topo=topo, costs=costs) for e in engines]


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
        rows.append([res.engine + (" +remap" if res.remap else ""), f"{res.iteration_time_s:.3f}",
                     f"{res.tokens_per_s:,.0f}", f"{100 * res.mfu:.1f}%", speed, f"{busy:.3f} s",
                     f"{100 * idle / res.iteration_time_s:.0f}%", f"{inter:.1f}"])
    return format_table(header, rows)


def main(args) -> int:
    recipe = load_recipe(args.recipe, args.set)
    if getattr(args, "compare", None):
        raise ConfigError("--compare: pipeline schedules cannot be combined with --cp-engine/--lengths "
                          "(allowed: one of them)")
    if not args.lengths:
        raise ConfigError(f"--lengths: required with --cp-engine (allowed: {' | '.join(SPEC_FORMS)})")
    engines = parse_engines(args.cp_engine) if args.cp_engine else (recipe.cp.engine,)
    packs, results = run_engines(recipe, engines, args.lengths, args.seed)
    payload: dict = {"recipe": recipe.name, "hardware": recipe.hardware, "lengths": args.lengths,
                     "seed": args.seed, "pack_lengths": [list(p) for p in packs]}
    if len(results) == 1:
        payload.update(results[0].to_json())
    else:
        payload["results"] = [r.to_json() for r in results]
    out = emit_json(payload, args.json, indent=1)
    p = recipe.parallel
    seqs = sum(len(pk) for pk in packs)
    print(f"recipe {recipe.name} on {recipe.hardware}: cp={p.cp} (tp{p.tp}), {len(packs)} packs of "
          f"{recipe.model.seq_length} tokens, {seqs} sequences from {args.lengths} (seed {args.seed})", file=out)
    print(table(results), file=out)
    return 0
