"""The end of ``megatron-slim train``: the summary it prints and the ``--json`` it writes, from the
ranks' ``RankReport`` values."""

from __future__ import annotations

import json
import sys
import time

from megatron_slim.commands.train_dynmo import dynmo_entry
from megatron_slim.plan.files import write_atomically

# training stopped on a non-finite loss or gradient norm, or a checkpoint it could not write (2 is a bad
# recipe or flag, 1 a crash)
STOPPED_EXIT_CODE = 3


def is_reporter(report, pp: int) -> bool:
    """The rank whose losses the summary shows: last pipeline stage, first tp/cp/dp rank."""
    return report.pp_rank == pp - 1 and report.dp_rank == 0 and report.tp_rank == 0 and report.cp_rank == 0


# per pipeline stage, from its RankReport (offloaded_bytes: per iteration, moved to host memory;
# exchanged_tokens: per iteration, K/V tokens shipped to context-exchange peers over all layers)
_STAGE_FIGURES = ("peak_activation_bytes", "peak_kv_bytes", "offloaded_bytes", "peak_p2p_bytes", "exchanged_tokens")


def _stage_entries(reports, pp: int) -> list[dict]:
    by_stage = {r.pp_rank: r for r in reports if r.dp_rank == 0 and r.tp_rank == 0 and r.cp_rank == 0}
    return [{"stage": s, **{k: int(getattr(by_stage[s], k)) for k in _STAGE_FIGURES}} for s in range(pp)]


def _cp_entry(recipe, reporter) -> dict:
    """The JSON ``cp`` section; packed windows and context exchange's plain windows run SlimPipe's
    query-out attention, no engine."""
    from megatron_slim.train.checks import cp_topology

    if recipe.query_out_cp:
        attention, engine = "slimpipe-query-out", "zeppelin" if recipe.cp_routes else None  # its CP-routed windows
        masking = not recipe.exchange_cp  # exchange's plain windows attend across eod, as parallel.cp=1 does
        entry = {"size": recipe.parallel.cp, "engine": engine, "attention": attention, "document_masking": masking}
        return {**entry, "cp_routes": True} if recipe.cp_routes else entry
    topo, _ = cp_topology(recipe)
    return {
        "size": recipe.parallel.cp,
        "engine": recipe.cp.engine,
        "attention": "engine",
        "remap": recipe.cp.remap,
        "nodes": topo.num_nodes,
        "ranks_per_node": topo.ranks_per_node,
        "document_masking": True,
        "iterations": reporter.cp_iterations,
    }


def report(args, recipe, reports, began) -> int:
    """Print the summary and write ``--json``; the exit code (``STOPPED_EXIT_CODE`` when training
    stopped on a non-finite loss or gradient norm)."""
    p, t = recipe.parallel, recipe.train
    reporter = next(r for r in reports if is_reporter(r, p.pp))
    seconds = sum(reporter.iteration_seconds)
    done = len(reporter.iteration_seconds)  # this process's iterations (a resumed run: since resuming)
    tokens = sum(r["document_tokens"] for r in reporter.packing) or t.global_batch_size * recipe.model.seq_length * done
    payload = {
        "recipe": recipe.name,
        "schedule": recipe.schedule.kind,
        "num_slices": recipe.schedule.num_slices,
        "schedule_digest": reporter.schedule_digest,
        "attention_backend": reporter.attention_backend,
        "losses": [loss for _, loss in reporter.losses],
        "loss_iterations": [i for i, _ in reporter.losses],
        "tokens_per_s": tokens / seconds if seconds else 0.0,
        "iteration_time_s": reporter.iteration_seconds,
        "skipped_steps": reporter.skipped_steps,
        "resumed_from": reporter.resumed_from,
        "last_iteration": reporter.last_iteration,
        "skipped_iterations": reporter.skipped_iterations,
        "stopped": reporter.stopped or None,
        "stages": _stage_entries(reports, p.pp),
        "wall_time_s": time.perf_counter() - began,
        **({"packing": reporter.packing} if reporter.packing else {}),
    }
    if p.cp > 1:
        payload["cp"] = _cp_entry(recipe, reporter)
    if recipe.dynmo.active:
        payload["dynmo"] = dynmo_entry(reports, p.pp)
    if args.json == "-":
        print(json.dumps(payload, indent=2))
    elif args.json:
        write_atomically(args.json, json.dumps(payload, indent=2) + "\n", "--json")
    if reporter.stopped:
        print(f"megatron-slim train: error: {reporter.stopped}", file=sys.stderr, flush=True)
    if args.json != "-" and payload["losses"]:
        first, last = payload["losses"][0], payload["losses"][-1]
        print(
            f"{'stopped' if reporter.stopped else 'done'}: loss {first:.4f} -> {last:.4f} over iterations "
            f"{payload['loss_iterations'][0]}..{payload['loss_iterations'][-1]}, {payload['tokens_per_s']:,.0f} "
            f"tokens/s, attention backend {reporter.attention_backend}",
            file=sys.stdout,
        )
        for s in payload["stages"]:
            print(
                f"  stage {s['stage']}: peak activations {s['peak_activation_bytes'] / 2**20:.2f} MiB, "
                f"peak K/V {s['peak_kv_bytes'] / 2**20:.2f} MiB, offloaded {s['offloaded_bytes'] / 2**20:.2f} MiB, "
                f"peak in-flight p2p {s['peak_p2p_bytes'] / 2**20:.2f} MiB"
                + (f", exchanged K/V tokens {s['exchanged_tokens']:,}" if s["exchanged_tokens"] else "")
            )
    return STOPPED_EXIT_CODE if reporter.stopped else 0
