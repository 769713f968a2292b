"""PNG of simulations: per-rank timelines and memory curves (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Sequence

from megatron_slim.plan.files import write_atomically
from megatron_slim.plan.sim.engine import Event, SimResult

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.patches import Patch

_GIB = 2**30
_COLORS = {
    "F": ("#4C78A8", "#9ECAE9"),
    "B": ("#54A24B", "#88D27A"),
    "I": ("#54A24B", "#88D27A"),
    "W": ("#B279A2", "#D6A5C9"),
}


def _kind(name: str) -> str:
    return name.lstrip("0123456789")[0]


def _timeline(ax: Axes, result: SimResult, title: str, t_max: float) -> None:
    draw_compute(ax, result.events, len(result.ranks), t_max)
    ax.set_title(
        f"{title}: iteration {result.iteration_time_s:.3g} s, bubble "
        f"{100 * result.bubble_ratio:.1f}%, MFU {100 * result.mfu:.1f}%, peak "
        f"{max(r.peak_memory_bytes for r in result.ranks) / _GIB:.1f} GiB",
        fontsize=10,
        loc="left",
    )


def draw_compute(ax: Axes, events: Iterable[Event], pp: int, t_max: float) -> None:
    """One row per pipeline rank: its compute events (forward blue, backward green, alternate
    microbatches lighter)."""
    bars: dict[tuple[int, str, int], list[tuple[float, float]]] = {}
    for e in events:
        if e.stream != "compute":
            continue
        k = _kind(e.name)
        bars.setdefault((e.rank, k, e.microbatch % 2), []).append((e.start, e.end - e.start))
    for (rank, k, shade), spans in bars.items():
        ax.broken_barh(spans, (rank - 0.4, 0.8), facecolors=_COLORS[k][shade], linewidth=0)
    ax.set_ylim(pp - 0.5, -0.5)
    ax.set_yticks(range(pp))
    ax.set_yticklabels([f"rank {r}" for r in range(pp)], fontsize=7 if pp > 8 else 9)
    ax.set_xlim(0, t_max)


def compute_legend() -> list[Patch]:
    from matplotlib.patches import Patch

    return [Patch(color=_COLORS[k][0], label=lbl) for k, lbl in (("F", "forward"), ("B", "backward"))]


def _memory(ax: Axes, result: SimResult, t_max: float) -> None:
    import matplotlib.pyplot as plt

    cmap = plt.get_cmap("viridis")
    pp = len(result.ranks)
    for r in result.ranks:
        xs: list[float] = []
        ys: list[float] = []
        for t, act, kv in r.memory:
            if xs:
                xs.append(t)
                ys.append(ys[-1])
            xs.append(t)
            ys.append((r.static_bytes + act + kv) / _GIB)
        xs.append(t_max)
        ys.append(ys[-1])
        ax.plot(
            xs,
            ys,
            color=cmap(r.rank / max(pp - 1, 1)),
            linewidth=1.0,
            label=f"rank {r.rank}" if pp <= 8 or r.rank in (0, pp - 1) else None,
        )
    ax.axhline(result.hbm_bytes / _GIB, color="#E45756", linestyle="--", linewidth=1, label="usable HBM")
    ax.set_ylabel("memory (GiB)")
    ax.set_xlim(0, t_max)
    ax.legend(fontsize=7, ncol=5, loc="upper right")


def plot_results(results: Sequence[tuple[str, SimResult]], path: str | Path) -> None:
    """One timeline per result (shared time axis), then memory: curves for one result, per-rank
    peak bars (activations / K/V / static) for a comparison."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(results)
    t_max = max(r.pipeline_time_s for _, r in results) * 1.01
    heights = [max(1.5, 0.22 * len(r.ranks)) for _, r in results] + [2.6]
    fig, axes = plt.subplots(n + 1, 1, figsize=(14, sum(heights) + 1.2), gridspec_kw={"height_ratios": heights})
    for ax, (title, res) in zip(axes[:n], results):
        _timeline(ax, res, title, t_max)
    axes[n - 1].set_xlabel("time (s)")
    axes[0].legend(handles=compute_legend(), fontsize=8, loc="upper right")
    if n == 1:
        _memory(axes[n], results[0][1], t_max)
        axes[n].set_xlabel("time (s)")
    else:
        _peak_bars(axes[n], results)
    fig.tight_layout()
    write_atomically(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"), "--plot")
    plt.close(fig)


def _peak_bars(ax: Axes, results: Sequence[tuple[str, SimResult]]) -> None:
    width = 0.8 / len(results)
    hatches = ["", "//", "..", "xx"]
    for i, (title, res) in enumerate(results):
        xs = [r.rank + (i - (len(results) - 1) / 2) * width for r in res.ranks]
        static = [r.static_bytes / _GIB for r in res.ranks]
        act = [r.peak_activation_bytes / _GIB for r in res.ranks]
        kv = [r.peak_kv_bytes / _GIB for r in res.ranks]
        hatch = hatches[i % len(hatches)]
        ax.bar(xs, static, width, color="#BAB0AC", hatch=hatch, label=f"{title}: static")
        ax.bar(xs, act, width, bottom=static, color="#4C78A8", hatch=hatch, label=f"{title}: activations")
        ax.bar(
            xs,
            kv,
            width,
            bottom=[s + a for s, a in zip(static, act)],
            color="#F58518",
            hatch=hatch,
            label=f"{title}: K/V",
        )
    ax.axhline(results[0][1].hbm_bytes / _GIB, color="#E45756", linestyle="--", linewidth=1, label="usable HBM")
    ax.set_xticks(range(len(results[0][1].ranks)))
    ax.set_xlabel("pipeline rank")
    ax.set_ylabel("peak memory (GiB)")
    ax.set_title(
        "peak memory per rank (activations + K/V peaks stacked on static; the true peak is at most their sum)",
        fontsize=9,
        loc="left",
    )
    tallest = max(r.static_bytes + r.peak_activation_bytes + r.peak_kv_bytes for _, res in results for r in res.ranks)
    ax.set_ylim(0, max(tallest, results[0][1].hbm_bytes) / _GIB * 1.55)  # room for the legend
    ax.legend(fontsize=7, ncol=len(results), loc="upper right")
