"""Chrome trace (Perfetto) of context-parallel simulations: what each rank and each of its links does.

Per engine a block of process ids (``1000 * i``): one process per CP rank with threads ``compute``
(attention and linear tasks, one at a time), ``NVLink out``/``NVLink in`` and ``NIC out``/``NIC in``
(each transfer's load on that link; a link serves one load at a time), and a ``packs`` process
marking each pass. Event names say what the task is: ``pre (norm, QKV, RoPE)``, ``mlp``,
``remap``, and for attention the step of the CP program that made it, by ``GroupTask.step_name``
(``cp fwd G3 zigzag/inter C2``, ``cp bwd G3 zigzag/inter POST_KV2``): the runtime's profiler labels
for the same steps. ``args.detail`` says which part of the step an event is (``seq 17 (4096
tokens)``, ``routed part 1 dispatch``, ``ring 0``).

The time axis shows **one decoder layer per pack**: pack 0's forward pass, its backward pass, then
pack 1's, and so on, back to back. Every layer of a pack repeats its pass, so the iteration is
``num_layers`` times longer than the trace (the ``packs`` events say so).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from megatron_slim.plan.files import write_atomically
from megatron_slim.plan.sim.cp.sim import CPSimResult

_THREADS = {
    "compute": (0, "compute"),
    "nvl_out": (1, "NVLink out"),
    "nvl_in": (2, "NVLink in"),
    "nic_out": (3, "NIC out"),
    "nic_in": (4, "NIC in"),
}


def cp_chrome_trace(results: Sequence[CPSimResult]) -> dict[str, Any]:
    """One trace of every engine in ``results`` (each simulated with ``record=True``)."""
    events: list[dict[str, Any]] = []
    other: dict[str, Any] = {"layout": "one decoder layer per pack, forward then backward, packs back to back"}
    for i, res in enumerate(results):
        if res.packs and not res.passes:
            raise ValueError(f"engine {res.engine}: simulated without record=True, nothing to trace")
        base = 1000 * i
        label = res.engine + (" +remap" if res.remap else "")
        for r in range(res.num_ranks):
            pid = base + r
            events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"{res.engine} rank {r}"}})
            events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}})
            for tid, name in _THREADS.values():
                events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
        packs_pid = base + res.num_ranks
        events.append({"ph": "M", "name": "process_name", "pid": packs_pid, "args": {"name": f"{label}: packs"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": packs_pid, "args": {"sort_index": base - 1}})
        offset = 0.0
        for layer_pass in res.passes:
            pack = res.packs[layer_pass.pack]
            events.append(
                {
                    "ph": "X",
                    "name": f"pack {layer_pass.pack} {layer_pass.phase} (1 of {res.num_layers} layers)",
                    "cat": "pack",
                    "pid": packs_pid,
                    "tid": 0,
                    "ts": offset * 1e6,
                    "dur": layer_pass.time_s * 1e6,
                    "args": {"sequences": pack.num_sequences, "longest": pack.longest, "plan_digest": pack.digest},
                }
            )
            for s in layer_pass.spans:  # microseconds to the nanosecond: keeps a 6-engine trace small
                events.append(
                    {
                        "ph": "X",
                        "name": s.name or s.category,
                        "cat": s.category,
                        "pid": base + s.rank,
                        "tid": _THREADS[s.stream][0],
                        "ts": round((offset + s.start) * 1e6, 3),
                        "dur": round((s.end - s.start) * 1e6, 3),
                        **({"args": {"detail": s.detail}} if s.detail else {}),
                    }
                )
            offset += layer_pass.time_s
        other[label] = {
            "iteration_time_s": res.iteration_time_s,
            "num_layers": res.num_layers,
            "packs": len(res.packs),
            "traced_s": offset,
        }
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def write_cp_trace(results: Sequence[CPSimResult], path: str | Path) -> None:
    write_atomically(path, json.dumps(cp_chrome_trace(results)), "--trace")
