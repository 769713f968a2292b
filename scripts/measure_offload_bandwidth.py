#!/usr/bin/env python
"""Measure pinned host<->device copy bandwidth, alone and beside a GEMM, for offload pricing.

    python scripts/measure_offload_bandwidth.py --hardware h100 --out out/offload.json   # CUDA
    python scripts/measure_offload_bandwidth.py --device cpu --sizes-mib 1,4 --gemm-size 64 \
        --hardware h100 --out /tmp/offload.json                                         # smoke run

Per size: host-to-device (``h2d``), device-to-host (``d2h``) and both at once (``both``, each on
its own stream), each ``alone`` and under ``gemm`` load (back-to-back bf16 GEMMs on a third
stream, queued to outlast the copies). Each direction's GB/s is the median over repeats of its
bytes over its own copy time (CUDA events on its stream); ``aggregate_gbps`` is all bytes moved
over the span from launch to the last copy's end; ``gemm_slowdown`` is the GEMMs' time beside the
copies over their time alone (the GEMMs are queued to last about 1.5x the copies alone, so
this dilutes the slowdown during the overlap by roughly that factor). The cost model prices an offloaded share at
``bytes / pcie_bandwidth`` each way (``plan/cost/model.py``), so the JSON carries the profile's
``pcie_bandwidth`` for comparison. On CPU the "device" is host memory and nothing overlaps: a
smoke run of the code path, not a measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_slim.plan.hardware import load_hardware  # noqa: E402

MIB = 2**20


class Clock:
    """Timestamps on a stream: CUDA events, or wall time on CPU (where every op is synchronous)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def stamp(self, stream=None):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def seconds(self, start, end) -> float:
        return start.elapsed_time(end) / 1e3 if self.cuda else end - start

    def stream(self):
        return torch.cuda.Stream() if self.cuda else None

    def on(self, stream):
        return torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext()

    def wait_launch(self, stream) -> None:
        if self.cuda:
            stream.wait_stream(torch.cuda.current_stream())

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def _buffers(nbytes: int, device: torch.device) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    pin = device.type == "cuda"
    host = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
    dev = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2)]
    return {"h2d": (dev[0], host[0]), "d2h": (host[1], dev[1])}  # (destination, source)


def _one_run(clock: Clock, streams, buffers, directions, gemm, gemms: int) -> dict:
    """One launch: ``gemms`` GEMMs on their stream (if any), then the copies; seconds of each."""
    clock.sync()
    t0 = clock.stamp()
    marks = {}
    for name in ["gemm"] * bool(gemms) + list(directions):
        clock.wait_launch(streams[name])
        with clock.on(streams[name]):
            start = clock.stamp(streams[name])
            if name == "gemm":
                for _ in range(gemms):
                    gemm()
            else:
                dst, src = buffers[name]
                dst.copy_(src, non_blocking=True)
            marks[name] = (start, clock.stamp(streams[name]))
    clock.sync()
    out = {name: clock.seconds(*pair) for name, pair in marks.items()}
    out["span"] = max((clock.seconds(t0, marks[d][1]) for d in directions), default=0.0)
    return out


def measure_size(clock, streams, nbytes, device, gemm, gemm_seconds, repeats) -> list[dict]:
    buffers = _buffers(nbytes, device)
    rows, alone = [], {}
    for load in ("alone", "gemm"):
        for mode, directions in (("h2d", ("h2d",)), ("d2h", ("d2h",)), ("both", ("h2d", "d2h"))):
            gemms = math.ceil(1.5 * alone[mode] / gemm_seconds) + 2 if load == "gemm" else 0
            runs = [_one_run(clock, streams, buffers, directions, gemm, gemms) for _ in range(repeats + 1)][1:]
            median = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            alone.setdefault(mode, median["span"])
            row = {"size_mib": nbytes / MIB, "mode": mode, "load": load, "gemms": gemms}
            row |= {f"{d}_gbps": nbytes / median[d] / 1e9 for d in directions}
            row["aggregate_gbps"] = len(directions) * nbytes / median["span"] / 1e9
            row["gemm_slowdown"] = median["gemm"] / (gemms * gemm_seconds) if gemms else None
            rows.append(row)
    return rows


def _gemm(device: torch.device, size: int):
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    c = torch.empty(size, size, device=device, dtype=dtype)
    return lambda: torch.mm(a, b, out=c)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--hardware", required=True, help="profile whose pcie_bandwidth the JSON quotes")
    p.add_argument("--sizes-mib", default="64,256,1024", help="comma-separated copy sizes in MiB")
    p.add_argument("--gemm-size", type=int, default=8192, help="the square GEMM run beside the copies")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per point (median), after one warm-up")
    p.add_argument("--out", required=True, help="JSON file to write")
    a = p.parse_args()
    device = torch.device(a.device)
    clock = Clock(device)
    streams = {name: clock.stream() for name in ("h2d", "d2h", "gemm")}
    gemm = _gemm(device, a.gemm_size)
    gemm_seconds = statistics.median(_one_run(clock, streams, {}, (), gemm, 1)["gemm"] for _ in range(6))
    rows = []
    for mib in (float(s) for s in a.sizes_mib.split(",")):
        rows += measure_size(clock, streams, int(mib * MIB), device, gemm, gemm_seconds, a.repeats)
    for r in rows:
        rates = "  ".join(f"{k} {r[k]:7.1f}" for k in ("h2d_gbps", "d2h_gbps", "aggregate_gbps") if k in r)
        slowdown = "" if r["gemm_slowdown"] is None else f"  gemm slowdown x{r['gemm_slowdown']:.2f}"
        print(f"{r['size_mib']:6.0f} MiB {r['mode']:<4} {r['load']:<5} GB/s: {rates}{slowdown}")
    hw = load_hardware(a.hardware)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke run, not a measurement)"
    result = {"device": name, "torch": torch.__version__, "pinned": device.type == "cuda"}
    result |= {"hardware": a.hardware, "profile_pcie_bandwidth_gbps": hw.pcie_bandwidth / 1e9}
    result |= {"gemm": {"size": a.gemm_size, "seconds": gemm_seconds}, "rows": rows}
    Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
