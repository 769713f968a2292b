#!/usr/bin/env python
"""Measure kernel rates for the cost model and write a calibration file (docs/calibration.md).

    python scripts/calibrate_gpu.py --hardware h100 --out calibration/h100.yaml
    python scripts/calibrate_gpu.py --device cpu --hardware cpu --sizes small --out /tmp/cpu.yaml

Times, on the chosen device: GEMMs of transformer shapes (FLOPs 2mnk), causal attention forward
and backward through megatron_slim.runtime.attention's selected backend (FLOPs counted as the cost
model counts them), and a memory-bound elementwise pass. Each point is the median of several timed
repeats after warm-up, synchronised on CUDA.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time

import torch
import yaml

SIZES = {
    "small": dict(
        gemm=[(256, 256, 256), (512, 512, 512), (1024, 1024, 1024)],
        attn=[(256, 4, 64), (512, 4, 64)],
        mem=[2**20, 2**22],
    ),
    "gpu": dict(
        gemm=[(2048, 4096, 4096), (8192, 4096, 11008), (16384, 8192, 8192), (32768, 8192, 28672)],
        attn=[(4096, 32, 128), (16384, 32, 128), (65536, 8, 128)],
        mem=[2**26, 2**28],
    ),
}


def _time(fn, device: torch.device, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(device: torch.device, dtype: torch.dtype, sizes: dict) -> list[dict]:
    from megatron_slim.runtime.attention import select_backend

    out = []
    for m, n, k in sizes["gemm"]:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        out.append(
            {"op": "gemm", "work": 2.0 * m * n * k, "seconds": _time(lambda: a @ b, device), "note": f"{m}x{k}@{k}x{n}"}
        )
    backend = select_backend(None, device, dtype)
    for s, heads, d in sizes["attn"]:
        q = torch.randn(1, s, heads, d, device=device, dtype=dtype)
        k = torch.randn(1, s, max(1, heads // 4), d, device=device, dtype=dtype)
        v = torch.randn_like(k)
        pairs = s * (s + 1) / 2
        fwd_flops = 4.0 * pairs * d * heads
        out.append(
            {
                "op": "attention_forward",
                "work": fwd_flops,
                "note": f"{backend.name} s={s} h={heads} d={d}",
                "seconds": _time(lambda: backend.forward(q, k, v, causal=True), device),
            }
        )
        o, lse = backend.forward(q, k, v, causal=True)
        dout = torch.randn_like(o)
        out.append(
            {
                "op": "attention_backward",
                "work": 2.5 * fwd_flops,
                "note": f"{backend.name} s={s}",
                "seconds": _time(lambda: backend.backward(dout, q, k, v, o, lse, causal=True), device),
            }
        )
    for numel in sizes["mem"]:
        x = torch.randn(numel, device=device, dtype=dtype)
        y = torch.randn_like(x)
        out.append(
            {
                "op": "memory_bound",
                "work": 3.0 * numel * x.element_size(),
                "note": "x + y",
                "seconds": _time(lambda: x + y, device),
            }
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hardware", required=True, help="profile name the file is for (megatron_slim/configs/hardware)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--sizes", choices=tuple(SIZES), default=None, help="default: gpu on cuda, small on cpu")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    device = torch.device(a.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    sizes = SIZES[a.sizes or ("gpu" if device.type == "cuda" else "small")]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    data = {
        "hardware": a.hardware,
        "source": f"scripts/calibrate_gpu.py on {name}, torch {torch.__version__}, {dtype}, "
        f"{datetime.date.today().isoformat()}",
        "measurements": measure(device, dtype, sizes),
    }
    with open(a.out, "w") as f:
        yaml.safe_dump(data, f, sort_keys=False)
    for m in data["measurements"]:
        print(f"{m['op']:<20} {m['note']:<36} {m['work'] / m['seconds'] / 1e12:8.3f} T/s")


if __name__ == "__main__":
    main()
