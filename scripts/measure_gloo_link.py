#!/usr/bin/env python
"""Measure the loopback gloo link between two local processes: per-message latency and bandwidth,
the numbers behind ``configs/hardware/cpu.yaml``'s ``nvlink_*`` / ``nic_*`` (both are gloo/TCP on
one host). Fits ``time = latency + bytes / bandwidth`` to the median of ``--iters`` ping-pongs
(half the round trip) per message size. Writes ``<out>/cpu_gloo_link.md``.

    python scripts/measure_gloo_link.py [--iters 20] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = (8, 4096, 65536, 1 << 20, 8 << 20, 32 << 20)  # bytes


def _worker(rank: int, port: int, iters: int, queue) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    out = {}
    for size in SIZES:
        buf = torch.zeros(size // 4 or 1, dtype=torch.float32)
        times = []
        for _ in range(iters + 2):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            times.append((time.perf_counter() - t0) / 2)
        out[size] = statistics.median(times[2:])
    if rank == 0:
        queue.put(out)
    dist.destroy_process_group()


def fit(points: dict[int, float]) -> tuple[float, float]:
    """Least squares ``t = a + b * bytes``: (latency s, bandwidth bytes/s)."""
    xs, ys = list(points), list(points.values())
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return max(points[min(xs)], 0.0), 1.0 / b


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    procs = [ctx.Process(target=_worker, args=(r, port, args.iters, queue)) for r in range(2)]
    for p in procs:
        p.start()
    points = queue.get(timeout=600)
    for p in procs:
        p.join()
    latency, bandwidth = fit(points)
    lines = [
        "# Loopback gloo link between two local processes (what `cpu.yaml` models as NVLink and NIC)",
        "",
        f"- command: `python {' '.join([sys.argv[0], *(argv or sys.argv[1:])])}`",
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M UTC}",
        f"- machine: {platform.platform()}, {os.cpu_count()} cores shared with other jobs "
        f"(load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}); torch {torch.__version__}",
        f"- fit `time = latency + bytes / bandwidth`: latency {latency * 1e6:.0f} us (8-byte message), "
        f"bandwidth {bandwidth / 1e9:.2f} GB/s",
        "",
        "| bytes | one-way s (median) | GB/s |",
        "|---|---|---|",
        *(f"| {size:,} | {t:.2e} | {size / t / 1e9:.3f} |" for size, t in points.items()),
        "",
    ]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu_gloo_link.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
