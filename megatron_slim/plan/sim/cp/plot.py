"""PNG of context-parallel simulations: where each engine's iteration time goes (matplotlib, Agg).

Top: per engine, the iteration split into attention, linear (QKV/output projections, MLP) and idle
time (waiting on communication or on other ranks), averaged over ranks. Below, one panel per
engine: each rank's attention and linear time against the iteration time, which shows how evenly
the engine spreads the work.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from megatron_slim.plan.files import write_atomically
from megatron_slim.plan.sim.cp.sim import CPSimResult

_PARTS = (("attention", "attention_s", "#4C78A8"), ("linear", "linear_s", "#54A24B"), ("idle", "idle_s", "#BAB0AC"))


def _label(res: CPSimResult) -> str:
    return res.engine + (" +remap" if res.remap else "")


def plot_cp_results(results: Sequence[CPSimResult], path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(results)
    heights = [max(1.6, 0.45 * n + 0.8)] + [1.7] * n
    fig, axes = plt.subplots(n + 1, 1, figsize=(12, sum(heights) + 1.0), gridspec_kw={"height_ratios": heights})
    top = axes[0]
    ring = next((r for r in results if r.engine == "ring"), None)
    for y, res in enumerate(results):
        left = 0.0
        for name, attr, color in _PARTS:
            mean = sum(getattr(r, attr) for r in res.ranks) / len(res.ranks)
            top.barh(y, mean, left=left, color=color, label=name if y == 0 else None)
            left += mean
        speed = f", {ring.iteration_time_s / res.iteration_time_s:.2f}x ring" if ring else ""
        top.text(left, y, f" {res.iteration_time_s:.3g} s, MFU {100 * res.mfu:.1f}%{speed}", va="center", fontsize=8)
    top.set_yticks(range(n))
    top.set_yticklabels([_label(r) for r in results])
    top.set_ylim(n - 0.5, -0.5)
    top.set_xlim(0, max(r.iteration_time_s for r in results) * 1.35)
    top.set_xlabel("seconds per iteration (mean over ranks)")
    first = results[0]
    top.set_title(
        f"{first.recipe} on {first.hardware}: {first.num_ranks} CP ranks, {len(first.packs)} packs of "
        f"{first.pack_length} tokens",
        fontsize=10,
        loc="left",
    )
    top.legend(fontsize=8, loc="lower right")
    for ax, res in zip(axes[1:], results):
        ranks = [r.rank for r in res.ranks]
        bottom = [0.0] * len(ranks)
        for _name, attr, color in _PARTS[:2]:
            values = [getattr(r, attr) for r in res.ranks]
            ax.bar(ranks, values, 0.8, bottom=bottom, color=color)
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.axhline(res.iteration_time_s, color="#E45756", linestyle="--", linewidth=1)
        ax.set_ylim(0, res.iteration_time_s * 1.12)
        ax.set_xlim(-0.6, len(ranks) - 0.4)
        ax.set_ylabel("s", fontsize=8)
        ax.set_title(
            f"{_label(res)}: busy time per rank (dashed: iteration {res.iteration_time_s:.3g} s; "
            "the gap above a bar is that rank's idle time)",
            fontsize=9,
            loc="left",
        )
        ax.tick_params(labelsize=7)
    axes[-1].set_xlabel("CP rank")
    fig.tight_layout()
    write_atomically(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"), "--plot")
    plt.close(fig)
