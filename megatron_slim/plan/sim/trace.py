"""Chrome trace (Perfetto) export of a simulation.

One process per rank, threads ``compute``/``send``/``recv``; every event is named by its IR action
string (``F3.2``, ``1B0.7``, ``SEND_F3.2``), so a runtime profile labelled with the same strings
lines up with it. Memory per rank is a counter track (GiB).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megatron_slim.plan.files import write_atomically
from megatron_slim.plan.sim.engine import SimResult

_THREADS = {"compute": 0, "send": 1, "recv": 2}
_GIB = 2**30


def chrome_trace(result: SimResult, label: str = "", pid_offset: int = 0) -> dict[str, Any]:
    """Trace of one result; ``pid_offset`` keeps several schedules apart in one file."""
    events: list[dict[str, Any]] = []
    for rank in result.ranks:
        events.append(
            {
                "ph": "M",
                "name": "process_name",
                "pid": pid_offset + rank.rank,
                "args": {
                    "name": f"{label + ' ' if label else ''}rank {rank.rank} (stages {','.join(map(str, rank.stages))})"
                },
            }
        )
        events.append(
            {
                "ph": "M",
                "name": "process_sort_index",
                "pid": pid_offset + rank.rank,
                "args": {"sort_index": pid_offset + rank.rank},
            }
        )
        for name, tid in _THREADS.items():
            events.append(
                {"ph": "M", "name": "thread_name", "pid": pid_offset + rank.rank, "tid": tid, "args": {"name": name}}
            )
    for e in result.events:
        events.append(
            {
                "ph": "X",
                "name": e.name,
                "cat": e.stream,
                "pid": pid_offset + e.rank,
                "tid": _THREADS[e.stream],
                "ts": e.start * 1e6,
                "dur": max(e.end - e.start, 0.0) * 1e6,
                "args": {"stage": e.stage, "microbatch": e.microbatch, "slice": e.slice},
            }
        )
    for rank in result.ranks:
        static = rank.static_bytes / _GIB
        for t, act, kv in rank.memory:
            events.append(
                {
                    "ph": "C",
                    "name": "memory (GiB)",
                    "pid": pid_offset + rank.rank,
                    "ts": t * 1e6,
                    "args": {"static": static, "activations": act / _GIB, "kv": kv / _GIB},
                }
            )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"schedule": result.schedule.kind, "digest": result.schedule.digest()},
    }


def write_chrome_trace_many(results: list[tuple[str, SimResult]], path: str | Path) -> None:
    """One file; each labelled result gets its own block of process ids."""
    merged: dict[str, Any] = {"traceEvents": [], "displayTimeUnit": "ms", "otherData": {}}
    for i, (label, result) in enumerate(results):
        trace = chrome_trace(result, label if len(results) > 1 else "", pid_offset=1000 * i)
        merged["traceEvents"] += trace["traceEvents"]
        merged["otherData"][label or result.schedule.kind] = trace["otherData"]
    write_atomically(path, json.dumps(merged), "--trace")
