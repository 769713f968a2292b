#!/usr/bin/env python
"""Measure kernel rates for the cost model and write a calibration file (docs/calibration.md).

    python scripts/calibrate_gpu.py --hardware h100 --out calibration/h100.yaml \
        [--out-cudnn calibration/h100-cudnn.yaml] [--json-extra out/blocks.json]
    python scripts/calibrate_gpu.py --device cpu --hardware cpu --sizes small --out /tmp/cpu.yaml

Times, on the chosen device: GEMMs of transformer shapes (FLOPs 2mnk), causal attention forward
and backward (FLOPs counted as the cost model counts them: 4·pairs·head_dim·heads forward, 2.5x
that backward) and a memory-bound elementwise pass. Each point is the median of several timed
repeats after warm-up; on CUDA with device events.

Attention is timed through ``megatron_slim.runtime.attention``'s selected backend (what
``megatron-slim train`` and the slice attentions run here), written to ``--out``. With
``--out-cudnn`` (CUDA only) it is timed again through torch's cuDNN fused attention (the kernel
family Transformer Engine's fused attention uses on Hopper) and a second file is written with the
same GEMM and memory-bound points. ``--json-extra`` adds non-causal blocks (ring / exchange
blocks) for the report; the cost model does not read them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time

import torch
import yaml

_LLAMA_SHAPES = [  # (n, k) of a decoder layer's GEMMs: 70B at tp8, 13B at tp2, 7B at tp1
    (1280, 8192),
    (8192, 1024),
    (7168, 8192),
    (8192, 3584),
    (7680, 5120),
    (5120, 2560),
    (12288, 4096),
    (4096, 11008),
]
SIZES = {
    "small": dict(
        gemm=[(256, 256, 256), (512, 512, 512), (1024, 1024, 1024)],
        attn=[(256, 4, 1, 64), (512, 4, 1, 64)],
        blocks=[(256, 4, 1, 64)],
        mem=[2**20, 2**22],
    ),
    "gpu": dict(
        gemm=[(m, n, k) for m in (512, 2048, 8192, 32768) for n, k in _LLAMA_SHAPES] + [(8192, 8192, 8192)],
        attn=[(2**e, 16, 2, 128) for e in range(8, 18)],
        blocks=[(2**e, 16, 2, 128) for e in range(8, 16)],
        mem=[2**22, 2**24, 2**26, 2**28, 2**30],
    ),
}


def _time(fn, device: torch.device, repeats: int = 7) -> float:
    for _ in range(2):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for begin, end in events:
        begin.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(b.elapsed_time(e) / 1e3 for b, e in events)


def _qkv(s: int, hq: int, hkv: int, d: int, device, dtype):
    q = torch.randn(1, s, hq, d, device=device, dtype=dtype)
    k = torch.randn(1, s, hkv, d, device=device, dtype=dtype)
    return q, k, torch.randn_like(k)


def measure_gemms(device, dtype, sizes) -> list[dict]:
    out = []
    for m, n, k in sizes["gemm"]:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        seconds = _time(lambda: a @ b, device)
        out.append({"op": "gemm", "work": 2.0 * m * n * k, "seconds": seconds, "note": f"{m}x{k}@{k}x{n}"})
    return out


def measure_memory(device, dtype, sizes) -> list[dict]:
    out = []
    for numel in sizes["mem"]:
        x = torch.randn(numel, device=device, dtype=dtype)
        y = torch.randn_like(x)
        work = 3.0 * numel * x.element_size()
        out.append({"op": "memory_bound", "work": work, "seconds": _time(lambda: x + y, device), "note": "x + y"})
    return out


def measure_backend_attention(device, dtype, shapes, causal: bool = True) -> list[dict]:
    from megatron_slim.runtime.attention import choose_backend

    choice = choose_backend(None, device, dtype)
    backend = choice.backend
    out = []
    for s, hq, hkv, d in shapes:
        q, k, v = _qkv(s, hq, hkv, d, device, dtype)
        pairs = s * (s + 1) / 2 if causal else s * s
        fwd = 4.0 * pairs * d * hq
        note = f"{choice.name} s={s} hq={hq} hkv={hkv} d={d} causal={causal}"
        seconds = _time(lambda: backend.forward(q, k, v, causal=causal), device)
        out.append({"op": "attention_forward", "work": fwd, "seconds": seconds, "note": note})
        o, lse = backend.forward(q, k, v, causal=causal)
        dout = torch.randn_like(o)
        seconds = _time(lambda: backend.backward(dout, q, k, v, o, lse, causal=causal), device)
        out.append({"op": "attention_backward", "work": 2.5 * fwd, "seconds": seconds, "note": note})
    return out


def measure_cudnn_attention(device, dtype, shapes) -> list[dict]:
    """torch's cuDNN fused attention, forward and (autograd) backward; heads expanded for GQA."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out = []
    for s, hq, hkv, d in shapes:
        q, k, v = (t.transpose(1, 2) for t in _qkv(s, hq, hkv, d, device, dtype))
        k, v = (t.repeat_interleave(hq // hkv, dim=1) for t in (k, v))
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        fwd = 4.0 * s * (s + 1) / 2 * d * hq
        note = f"cudnn s={s} hq={hq} hkv={hkv} d={d} causal=True"
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            seconds = _time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), device)
            out.append({"op": "attention_forward", "work": fwd, "seconds": seconds, "note": note})
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            dout = torch.randn_like(o)
            grad = lambda: torch.autograd.grad(o, (q, k, v), dout, retain_graph=True)  # noqa: E731
            out.append({"op": "attention_backward", "work": 2.5 * fwd, "seconds": _time(grad, device), "note": note})
    return out


def _write(path: str, hardware: str, source: str, measurements: list[dict]) -> None:
    with open(path, "w") as f:
        yaml.safe_dump({"hardware": hardware, "source": source, "measurements": measurements}, f, sort_keys=False)


def _print(measurements: list[dict]) -> None:
    for m in measurements:
        print(f"{m['op']:<20} {m['note']:<44} {m['work'] / m['seconds'] / 1e12:9.3f} T/s  {m['seconds'] * 1e3:9.3f} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hardware", required=True, help="profile name the file is for (megatron_slim/configs/hardware)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--sizes", choices=tuple(SIZES), default=None, help="default: gpu on cuda, small on cpu")
    p.add_argument("--out", required=True, help="calibration file, attention through the selected backend")
    p.add_argument("--out-cudnn", default=None, help="(cuda) calibration file, attention through cuDNN")
    p.add_argument("--json-extra", default=None, help="non-causal attention blocks, for reports")
    a = p.parse_args()
    device = torch.device(a.device)
    if a.out_cudnn and device.type != "cuda":
        p.error(f"--out-cudnn needs --device cuda (got {a.device})")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    sizes = SIZES[a.sizes or ("gpu" if device.type == "cuda" else "small")]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    source = f"scripts/calibrate_gpu.py on {name}, torch {torch.__version__}, {dtype}, {datetime.date.today()}"
    shared = measure_gemms(device, dtype, sizes) + measure_memory(device, dtype, sizes)
    attention = measure_backend_attention(device, dtype, sizes["attn"])
    _write(a.out, a.hardware, source, shared + attention)
    _print(shared + attention)
    if a.out_cudnn:
        cudnn = measure_cudnn_attention(device, dtype, sizes["attn"])
        _write(a.out_cudnn, a.hardware, source + ", attention: torch cuDNN fused attention", shared + cudnn)
        _print(cudnn)
    if a.json_extra:
        blocks = measure_backend_attention(device, dtype, sizes["blocks"], causal=False)
        with open(a.json_extra, "w") as f:
            json.dump({"source": source, "measurements": blocks}, f, indent=1)
        _print(blocks)


if __name__ == "__main__":
    main()
