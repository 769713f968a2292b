"""Measured beside simulated: the per-rank timelines of one traced iteration and of the simulation
of the same recipe and schedule, on one time axis from zero, and their busy time per rank."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_slim.plan.files import write_atomically
from megatron_slim.plan.sim.engine import SimResult
from megatron_slim.plan.sim.measured import MeasuredRun
from megatron_slim.plan.sim.plot import compute_legend, draw_compute

if TYPE_CHECKING:
    from matplotlib.axes import Axes


@dataclass(frozen=True)
class RankComparison:
    rank: int
    stages: tuple[int, ...]
    measured_busy_s: float
    simulated_busy_s: float

    @property
    def ratio(self) -> float:
        return self.measured_busy_s / self.simulated_busy_s if self.simulated_busy_s > 0 else float("inf")


def compare_ranks(measured: MeasuredRun, simulated: SimResult) -> list[RankComparison]:
    return [RankComparison(r.rank, r.stages, measured.busy_s[r.rank], r.busy_s) for r in simulated.ranks]


def plot_overlay(measured: MeasuredRun, simulated: SimResult, hardware: str, path: str | Path) -> None:
    """Three panels: measured timeline, simulated timeline (shared time axis), busy time per rank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pp = simulated.schedule.pp
    t_max = max(measured.pipeline_time_s, simulated.pipeline_time_s) * 1.01
    row = max(1.5, 0.3 * pp)
    fig, axes = plt.subplots(3, 1, figsize=(14, 2 * row + 3.4), gridspec_kw={"height_ratios": [row, row, 2.2]})
    titles = (
        f"measured: iteration {measured.iteration} of run {measured.run_id}, pipeline "
        f"{measured.pipeline_time_s:.3g} s, bubble {100 * measured.bubble_ratio:.1f}%",
        f"simulated on {hardware}: pipeline {simulated.pipeline_time_s:.3g} s, bubble "
        f"{100 * simulated.bubble_ratio:.1f}%",
    )
    for ax, events, title in zip(axes[:2], (measured.events, simulated.events), titles):
        draw_compute(ax, events, pp, t_max)
        ax.set_title(title, fontsize=10, loc="left")
    axes[0].legend(handles=compute_legend(), fontsize=8, loc="upper right")
    axes[1].set_xlabel("time from the iteration's first forward (s)")
    _busy_bars(axes[2], compare_ranks(measured, simulated))
    fig.tight_layout()
    write_atomically(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"), "--plot")
    plt.close(fig)


def _busy_bars(ax: Axes, rows: list[RankComparison]) -> None:
    xs = [r.rank for r in rows]
    ax.bar([x - 0.2 for x in xs], [r.measured_busy_s for r in rows], 0.4, color="#4C78A8", label="measured")
    ax.bar([x + 0.2 for x in xs], [r.simulated_busy_s for r in rows], 0.4, color="#F58518", label="simulated")
    ax.set_xticks(xs)
    ax.set_xticklabels([f"rank {r.rank}" for r in rows])
    ax.set_ylabel("busy (s)")
    ax.set_title("compute time per pipeline rank (forward + backward actions)", fontsize=9, loc="left")
    ax.legend(fontsize=8, loc="upper right")
