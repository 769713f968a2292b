#!/usr/bin/env python
"""Time a taker's own work beside a served exchange block on another CUDA stream.

    python scripts/measure_served_overlap.py --out served_overlap.json
    python scripts/measure_served_overlap.py --device cpu --tokens 256 --out /tmp/overlap.json
    python scripts/measure_served_overlap.py --device cpu --tokens 32 --hidden-size 256 --out /tmp/o.json  # a check

The simulator prices a taker as busy for its own work plus every block it serves
(``plan/sim/engine.py``); the runtime serves a block on a thread with its own CUDA stream
(``runtime/pipeline/exchange_server.py``) while the taker runs its own layer. This measures one
layer's own work (the decoder layer's GEMMs and its causal attention) alone, one served block
(unmasked attention of a slice's queries to a K/V range, forward or backward) alone, and both at
once on two streams: ``overlapped / (own + block)`` below 1 means the two share the GPU better than
the model's sum, above 1 worse. Timing: wall clock around ``repeats`` rounds after a warm-up, with
device synchronisation.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from contextlib import nullcontext

import torch

from megatron_slim.runtime.attention import select_backend


def _layer_work(x: torch.Tensor, weights: list[torch.Tensor], backend, heads: int, kv_heads: int):
    """One decoder layer's GEMMs (QKV, output, SwiGLU) and its causal attention, no autograd."""
    tokens, hidden = x.shape
    head_dim = hidden // heads
    qkv = x @ weights[0]
    q = qkv[:, :hidden].view(1, tokens, heads, head_dim)
    k = qkv[:, hidden : hidden + kv_heads * head_dim].view(1, tokens, kv_heads, head_dim)
    v = qkv[:, hidden + kv_heads * head_dim :].view(1, tokens, kv_heads, head_dim)
    out, _ = backend.forward(q, k, v, causal=True, softmax_scale=head_dim**-0.5)
    y = out.reshape(tokens, hidden) @ weights[1]
    gate_up = y @ weights[2]
    ffn = gate_up.shape[1] // 2
    return (torch.nn.functional.silu(gate_up[:, :ffn]) * gate_up[:, ffn:]) @ weights[3]


def _timed(fn, device: torch.device, repeats: int) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / repeats


def measure(
    device: torch.device, dtype: torch.dtype, tokens: int, block_keys: int, backward: bool, repeats: int, hidden: int
):
    # Llama-2-7B's proportions (hidden 4096: 32 heads of 128, 8 K/V groups, FFN 11008) at any hidden size
    heads = max(1, hidden // 128)
    kv_heads, ffn = max(1, heads // 4), hidden * 11008 // 4096
    head_dim = hidden // heads
    backend = select_backend(None, device, dtype)
    make = lambda *shape: torch.randn(*shape, device=device, dtype=dtype) * 0.02  # noqa: E731
    x = make(tokens, hidden)
    weights = [
        make(hidden, hidden + 2 * kv_heads * head_dim),
        make(hidden, hidden),
        make(hidden, 2 * ffn),
        make(ffn, hidden),
    ]
    q, dout = make(1, tokens, heads, head_dim), make(1, tokens, heads, head_dim)
    k, v = make(1, block_keys, kv_heads, head_dim), make(1, block_keys, kv_heads, head_dim)
    scale = head_dim**-0.5
    out, lse = backend.forward(q, k, v, causal=False, softmax_scale=scale)

    def own():
        _layer_work(x, weights, backend, heads, kv_heads)

    def block():
        if backward:
            backend.backward(dout, q, k, v, out, lse, causal=False, softmax_scale=scale)
        else:
            backend.forward(q, k, v, causal=False, softmax_scale=scale)

    side = torch.cuda.Stream(device) if device.type == "cuda" else None

    def both():
        def serve():
            with torch.cuda.stream(side) if side is not None else nullcontext():
                block()
            if side is not None:
                side.synchronize()

        thread = threading.Thread(target=serve)
        thread.start()
        own()
        thread.join()

    with torch.no_grad():
        t_own, t_block, t_both = (_timed(f, device, repeats) for f in (own, block, both))
    return {
        "tokens": tokens,
        "block_keys": block_keys,
        "block_pass": "backward" if backward else "forward",
        "own_s": t_own,
        "block_s": t_block,
        "overlapped_s": t_both,
        "overlapped_over_sum": t_both / (t_own + t_block),
        "backend": type(backend).__name__,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--hidden-size", type=int, default=4096, help="the layer's hidden size (default 4096: Llama-2-7B's layer)"
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for tokens in args.tokens:
        for keys in (tokens // 4, tokens * 2):
            for backward in (False, True):
                row = measure(device, dtype, tokens, keys, backward, args.repeats, args.hidden_size)
                rows.append(row)
                print(
                    f"s={tokens:6d} keys={keys:6d} {row['block_pass']:8s} own {row['own_s'] * 1e3:8.3f} ms  "
                    f"block {row['block_s'] * 1e3:8.3f} ms  both {row['overlapped_s'] * 1e3:8.3f} ms  "
                    f"both/(own+block) {row['overlapped_over_sum']:.3f}"
                )
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    with open(args.out, "w") as f:
        meta = {"device": name, "torch": torch.__version__, "dtype": str(dtype), "hidden_size": args.hidden_size}
        json.dump({**meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
