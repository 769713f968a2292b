#!/usr/bin/env python
"""Slice attention with a K/V prefix vs full-sequence attention doing the same work.

    python scripts/bench_slice_attention.py                       # GPU: 32K..128K tokens, bf16
    python scripts/bench_slice_attention.py --device cpu --lengths 2048 4096 --out-md /tmp/x.md

For each total length S: ``full`` is one causal attention over S tokens, forward + backward;
``sliced`` runs S as n slices through megatron-slim's K/V-cached slice attention (forward in order,
backward in reverse with dK/dV accumulation), the SlimPipe path. Both score the same causal pairs,
so TFLOP/s compare directly (FLOPs: forward 4·pairs·d·h, backward 2.5x, as the cost model counts).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device, repeats):
    fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench(total: int, slices: int, heads: int, kv_heads: int, dim: int, device, dtype, repeats: int) -> dict:
    from megatron_slim.runtime.attention import attention, select_backend
    from megatron_slim.runtime.pipeline.kv_cache import KVCacheStore
    from megatron_slim.runtime.pipeline.slice_attention import sliced_attention
    from megatron_slim.runtime.pipeline.slice_context import SliceInfo

    backend = select_backend(None, device, dtype)
    g = torch.Generator(device="cpu").manual_seed(total)
    q = torch.randn(1, total, heads, dim, generator=g).to(device, dtype)
    k = torch.randn(1, total, kv_heads, dim, generator=g).to(device, dtype)
    v = torch.randn(1, total, kv_heads, dim, generator=g).to(device, dtype)
    dout = torch.randn(1, total, heads, dim, generator=g).to(device, dtype)
    scale = dim**-0.5

    def full():
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        attention(qq, kk, vv, causal=True, softmax_scale=scale, backend=backend).backward(dout)

    n = total // slices

    def sliced():
        store = KVCacheStore()
        outs = []
        for j in range(slices):
            part = slice(j * n, (j + 1) * n)
            qq, kk, vv = (t[:, part].detach().requires_grad_() for t in (q, k, v))
            outs.append(
                sliced_attention(
                    qq,
                    kk,
                    vv,
                    backend=backend,
                    softmax_scale=scale,
                    store=store,
                    info=SliceInfo(0, j, slices, j * n, n),
                    layer=1,
                )
            )
        for j in reversed(range(slices)):
            outs[j].backward(dout[:, j * n : (j + 1) * n])

    pairs = total * (total + 1) / 2
    flops = 3.5 * 4 * pairs * dim * heads
    t_full = _timed(full, device, repeats)
    t_sliced = _timed(sliced, device, repeats)
    return {
        "tokens": total,
        "slices": slices,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": dim,
        "backend": backend.name,
        "full_s": t_full,
        "sliced_s": t_sliced,
        "full_tflops": flops / t_full / 1e12,
        "sliced_tflops": flops / t_sliced / 1e12,
        "sliced_over_full": t_full / t_sliced,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None)
    p.add_argument("--lengths", type=int, nargs="+", default=[32768, 65536, 131072])
    p.add_argument("--slices", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out-json")
    p.add_argument("--out-md")
    a = p.parse_args()
    device = torch.device(a.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    rows = [
        bench(s, n, a.heads, a.kv_heads, a.head_dim, device, dtype, a.repeats)
        for s in a.lengths
        for n in a.slices
        if s % n == 0
    ]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or platform.machine())
    header = (
        f"command: {' '.join(['python', *sys.argv])}\nmachine: {name} ({platform.platform()}), torch "
        f"{torch.__version__}, {dtype}\ndate: {datetime.date.today().isoformat()}"
    )
    table = [
        "| tokens | slices | backend | full TFLOP/s | sliced TFLOP/s | sliced/full speed |",
        "|---:|---:|---|---:|---:|---:|",
    ]
    table += [
        f"| {r['tokens']} | {r['slices']} | {r['backend']} | {r['full_tflops']:.3f} | "
        f"{r['sliced_tflops']:.3f} | {r['sliced_over_full']:.2f} |"
        for r in rows
    ]
    print(header + "\n\n" + "\n".join(table))
    if a.out_json:
        Path(a.out_json).write_text(json.dumps({"header": header, "rows": rows}, indent=2) + "\n")
    if a.out_md:
        Path(a.out_md).write_text(
            "# Slice attention vs full-sequence attention (forward + backward)\n\n"
            + "```\n"
            + header
            + "\n```\n\n"
            + "\n".join(table)
            + "\n"
        )


if __name__ == "__main__":
    main()
