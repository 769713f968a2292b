"""Measured pipeline timelines: the traces ``megatron-slim train --profile DIR`` writes, read as the
simulator's events so the two can be laid side by side.

Each trace is one rank's torch profiler Chrome trace of one iteration; the schedule interpreter
named each action's event by its IR string (``F3.2``, ``1B0.7``, ``SEND_F3.2``) and the trace's
``megatron_slim`` entry says which rank, run, recipe and schedule it belongs to. One timeline per
pipeline rank is taken from the ranks with tp, cp and dp rank 0 (the others run the same program).
Times are the profiler's wall clock (``baseTimeNanoseconds`` + ``ts``; comparable across the
processes of one machine), shifted so that zero is the iteration's first compute action on any
pipeline rank, as the simulator's zero is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from megatron_slim.plan.schedule.ir import Action, Kind
from megatron_slim.plan.schema import ConfigError
from megatron_slim.plan.sim.engine import Event

METADATA_KEY = "megatron_slim"  # the key megatron_slim.train.profiler writes
TRACE_GLOB = "rank_*.trace.json"
_ALLOWED = f"the directory `megatron-slim train --profile DIR` wrote, or its {TRACE_GLOB} files"
_META_KEYS = {"pp_rank", "tp_rank", "cp_rank", "dp_rank", "recipe", "run_id", "iteration", "schedule_digest"}
# what must agree between the traced run and the recipe simulated beside it
COMPARED = {
    "model": None,
    "parallel": None,
    "schedule": None,
    "cp": None,
    "train": ("micro_batch_size", "global_batch_size"),
}


@dataclass(frozen=True)
class MeasuredRun:
    recipe: dict[str, Any]  # the recipe the traced run trained
    iteration: int
    run_id: str
    schedule_digest: str
    events: tuple[Event, ...]  # one pipeline column, time zero at the iteration's first compute action
    busy_s: tuple[float, ...]  # per pipeline rank: the time its compute actions (F, B) took
    pipeline_time_s: float  # zero to the last action's end

    @property
    def pp(self) -> int:
        return len(self.busy_s)

    @property
    def bubble_ratio(self) -> float:
        span = self.pp * self.pipeline_time_s
        return 1.0 - sum(self.busy_s) / span if span > 0 else 0.0


def trace_files(paths: Sequence[str]) -> list[Path]:
    files: list[Path] = []
    for text in paths:
        path = Path(text)
        if path.is_dir():
            found = sorted(path.glob(TRACE_GLOB))
            if not found:
                raise ConfigError(f"--measured {text}: no {TRACE_GLOB} in this directory; allowed: {_ALLOWED}")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise ConfigError(f"--measured {text}: no such file or directory; allowed: {_ALLOWED}")
    return files


def _load(path: Path) -> dict[str, Any]:
    try:
        trace = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--measured {path}: cannot read it as a JSON trace ({exc}); allowed: {_ALLOWED}") from None
    meta = trace.get(METADATA_KEY) if isinstance(trace, dict) else None
    if not isinstance(meta, dict) or not isinstance(trace.get("traceEvents"), list):
        raise ConfigError(
            f"--measured {path}: not a trace of `megatron-slim train --profile` (no "
            f"'{METADATA_KEY}' entry); allowed: {_ALLOWED}"
        )
    missing = sorted(_META_KEYS - set(meta))
    if missing or not isinstance(meta.get("recipe"), dict):
        raise ConfigError(
            f"--measured {path}: its '{METADATA_KEY}' entry lacks {', '.join(missing) or 'a recipe'} "
            f"(written by another megatron-slim version?); allowed: {_ALLOWED}"
        )
    checked: dict[str, Any] = trace
    return checked


def _pipeline_column(traces: dict[Path, dict[str, Any]]) -> list[tuple[Path, dict[str, Any]]]:
    """The trace of each pipeline rank at tp = cp = dp = 0, every pipeline rank present."""
    runs = sorted({t[METADATA_KEY]["run_id"] for t in traces.values()})
    if len(runs) > 1:
        raise ConfigError(
            f"--measured: the traces come from {len(runs)} different runs ({', '.join(runs)}); "
            "allowed: one run's traces (give each run its own --profile directory)"
        )
    column = {}
    for path, trace in traces.items():
        m = trace[METADATA_KEY]
        if m["tp_rank"] == m["cp_rank"] == m["dp_rank"] == 0:
            column[m["pp_rank"]] = (path, trace)
    pp = next(iter(traces.values()))[METADATA_KEY]["recipe"]["parallel"]["pp"]
    missing = [r for r in range(pp) if r not in column]
    if missing:
        raise ConfigError(
            f"--measured: no trace of pipeline rank(s) {missing} (tp, cp and dp rank 0) among "
            f"{len(traces)} file(s); allowed: {_ALLOWED}, with every rank's file"
        )
    return [column[r] for r in range(pp)]


def _stream(kind: Kind) -> str:
    if kind.is_compute:
        return "compute"
    return "send" if kind in (Kind.SEND_F, Kind.SEND_B) else "recv"


def _actions(trace: dict[str, Any], reference_ns: int) -> list[tuple[float, float, Action]]:
    """(start, duration) in µs of every action event, on the profiler's wall clock counted from
    ``reference_ns`` (integer nanoseconds first: the absolute clock in µs loses sub-µs digits)."""
    base_us = (int(trace.get("baseTimeNanoseconds", 0)) - reference_ns) / 1e3
    out = []
    for e in trace["traceEvents"]:
        if e.get("ph") != "X" or e.get("cat") != "user_annotation":
            continue
        try:
            action = Action.parse(e.get("name", ""))
        except ValueError:
            continue
        out.append((base_us + float(e["ts"]), float(e.get("dur", 0.0)), action))
    return out


def read_measured(paths: Sequence[str]) -> MeasuredRun:
    traces = {p: _load(p) for p in trace_files(paths)}
    column = _pipeline_column(traces)
    meta = column[0][1][METADATA_KEY]
    pp = meta["recipe"]["parallel"]["pp"]
    reference = min(int(trace.get("baseTimeNanoseconds", 0)) for _, trace in column)
    actions = [_actions(trace, reference) for _, trace in column]
    empty = [str(path) for (path, _), acts in zip(column, actions) if not any(a.kind.is_compute for *_, a in acts)]
    if empty:
        raise ConfigError(
            f"--measured {empty[0]}: no schedule actions (F3.2, B0.1, ...) in the trace; allowed: {_ALLOWED}"
        )
    # zero: the first compute action (stage 0's first forward), as in the simulator; a rank that
    # reached the iteration early and waits in a receive starts before it
    zero = min(start for acts in actions for start, _, a in acts if a.kind.is_compute)
    events, busy = [], []
    for rank, acts in enumerate(actions):
        busy.append(sum(dur for _, dur, a in acts if a.kind.is_compute) / 1e6)
        events += [
            Event(
                rank,
                _stream(a.kind),
                str(a),
                (start - zero) / 1e6,
                (start + dur - zero) / 1e6,
                a.chunk * pp + rank,
                a.microbatch,
                a.slice,
            )
            for start, dur, a in acts
        ]
    end = max(e.end for e in events)
    return MeasuredRun(
        meta["recipe"],
        meta["iteration"],
        meta["run_id"],
        meta["schedule_digest"],
        tuple(sorted(events, key=lambda e: (e.rank, e.start))),
        tuple(busy),
        end,
    )


def check_same_recipe(measured: MeasuredRun, recipe: dict[str, Any]) -> None:
    """The recipe simulated must be the one traced, up to what leaves the iteration unchanged
    (``train.iters``, data, hardware, ...)."""
    diff = []
    for section, keys in COMPARED.items():
        ran, given = measured.recipe.get(section, {}), recipe.get(section, {})
        for key in keys or sorted(set(ran) | set(given)):
            if ran.get(key) != given.get(key):
                diff.append(f"{section}.{key} (traced {ran.get(key)!r}, given {given.get(key)!r})")
    if diff:
        raise ConfigError(
            f"--recipe {recipe.get('name')}: differs from the traced run's recipe "
            f"{measured.recipe.get('name')} in {', '.join(diff)}; allowed: the traced run's "
            "recipe and --set overrides"
        )
