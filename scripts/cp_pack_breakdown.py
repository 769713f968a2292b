"""Per-pack breakdown for ``bench_cp_engines.py``: which placement Zeppelin kept for every pack, its
simulated time against the best other engine's, and the planner's cost model (``plan/cp/price.py``)
split into compute, intra-node, inter-node and idle for both placements -- what explains a margin.

Imported by ``scripts/bench_cp_engines.py``; not a command of its own.
"""

from __future__ import annotations

import statistics
from typing import Any

from megatron_slim.plan.cp.choose import choose_placement
from megatron_slim.plan.cp.costs import CPCosts
from megatron_slim.plan.cp.price import COMPONENTS
from megatron_slim.plan.cp.topology import CPTopology

OTHERS = ("ring", "ulysses", "a2a+p2p", "allgather", "dynamic")


def pack_rows(
    dist: str,
    seed: int,
    packs: tuple[tuple[int, ...], ...],
    pack_times: dict[str, list[float]],
    topo: CPTopology,
    costs: CPCosts,
    layers: int,
) -> list[dict[str, Any]]:
    """``pack_times[engine][k]``: simulated seconds of pack ``k`` (all layers)."""
    rows = []
    for k, pack in enumerate(packs):
        choice = choose_placement(pack, topo, costs, price_all=True)  # the other engine's price too
        zep = pack_times["zeppelin"][k]
        other = min(OTHERS, key=lambda e: pack_times[e][k])
        row: dict[str, Any] = {
            "distribution": dist,
            "seed": seed,
            "pack": k,
            "sequences": len(pack),
            "longest": max(pack),
            "picked": choice.picked,
            "zeppelin_s": zep,
            "best_other": other,
            "best_other_s": pack_times[other][k],
            "pruned": list(choice.pruned),
        }
        for name, label in ((choice.picked, "picked"), (other, "other")):
            cost = choice.priced.get(name)
            for part in COMPONENTS:
                row[f"{label}_{part}_ms"] = 1e3 * cost.breakdown()[part] if cost else None
            row[f"{label}_estimate_s"] = layers * cost.time_s if cost else None
        rows.append(row)
    return rows


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def markdown(rows: list[dict[str, Any]], header_lines: list[str]) -> str:
    lines = [
        "# Context-parallel engines: Zeppelin's pick per pack, with the cost model's breakdown",
        "",
        *header_lines,
        "- per pack: the placement Zeppelin kept (`CPPlan.picked`), its simulated time and the best "
        "other engine's (all layers, seconds), the margin (other / Zeppelin), and the planner's cost "
        "model for both placements as ms per layer (forward + backward), mean over ranks: compute "
        "(attention + token work), exposed intra-node and inter-node communication, idle (waiting for "
        "the busiest rank, or for a partner that reaches a shared group late); the four sum to the "
        "estimated layer time",
        "",
    ]
    for dist in dict.fromkeys(r["distribution"] for r in rows):
        sel = [r for r in rows if r["distribution"] == dist]
        picks: dict[str, int] = {}
        for r in sel:
            picks[r["picked"]] = picks.get(r["picked"], 0) + 1
        margins = [r["best_other_s"] / r["zeppelin_s"] for r in sel]
        lines += [
            f"## {dist}",
            "",
            f"picks: {', '.join(f'{k} {v}' for k, v in sorted(picks.items(), key=lambda kv: -kv[1]))}; "
            f"per-pack margin min {min(margins):.3f}, mean {statistics.fmean(margins):.3f}",
            "",
            "| seed | pack | seqs | longest | picked | zeppelin s | best other | other s | margin | "
            "picked: compute / intra / inter / idle ms | other: compute / intra / inter / idle ms |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in sel:
            mine = " / ".join(_ms(r[f"picked_{p}_ms"]) for p in COMPONENTS)
            theirs = " / ".join(_ms(r[f"other_{p}_ms"]) for p in COMPONENTS)
            lines.append(
                f"| {r['seed']} | {r['pack']} | {r['sequences']} | {r['longest']} | {r['picked']} | "
                f"{r['zeppelin_s']:.3f} | {r['best_other']} | {r['best_other_s']:.3f} | "
                f"{r['best_other_s'] / r['zeppelin_s']:.3f} | {mine} | {theirs} |"
            )
        lines.append("")
    return "\n".join(lines)
