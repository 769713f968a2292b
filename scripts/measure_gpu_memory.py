#!/usr/bin/env python
"""Measure the bytes one Llama decoder layer saves for backward, against the cost model.

    python scripts/measure_gpu_memory.py --out out/layer_memory.json            # CUDA, bf16
    python scripts/measure_gpu_memory.py --device cpu --hidden 64 --heads 4 --kv-heads 2 \
        --ffn 160 --tokens 64,128 --out /tmp/layer_memory.json

The layer is the one ``megatron-slim train`` builds (megatron-core's local spec: torch RMSNorm,
fused QKV projection split per query group, unfused RoPE, ``megatron_slim.runtime.attention``,
unfused SwiGLU, no biases), rebuilt here from torch alone so the script runs without
megatron-core. Per token count it reports, on CUDA, ``torch.cuda.memory_allocated`` after the
forward minus before (the input already allocated, so this is the layer's saved tensors plus its
output, i.e. a stack of layers' per-layer cost), the forward and backward peaks above their
starting points, and on every device the unique storages autograd saved (weights left out),
against ``LayerShape.activation_bytes`` for ``layer_impl`` ``local`` and ``te`` plus ``kv_bytes``
(the model counts K and V apart, as K/V cache).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_slim.plan.cost.layer import LayerShape  # noqa: E402
from megatron_slim.runtime.attention import attention, choose_backend  # noqa: E402

EPS = 1e-5


def rope_freqs(tokens: int, head_dim: int, device) -> torch.Tensor:
    """megatron's fp32 RoPE table ``[s, 1, 1, d]``."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(tokens, device=device, dtype=torch.float32), inv_freq)
    return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]


def _rope(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """megatron's unfused RoPE: cos/sin made per call in t's dtype, so q and k each keep a pair."""
    cos, sin = freqs.cos().to(t.dtype), freqs.sin().to(t.dtype)
    x1, x2 = torch.chunk(t, 2, dim=-1)
    return t * cos + torch.cat((-x2, x1), dim=-1) * sin


class LlamaLayer(nn.Module):
    """One decoder layer, inputs and outputs ``[s, b, h]`` as in megatron-core."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn: int, backend):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        qkv = (heads + 2 * kv_heads) * self.head_dim
        self.norm1, self.norm2 = nn.RMSNorm(hidden, eps=EPS), nn.RMSNorm(hidden, eps=EPS)
        self.qkv = nn.Linear(hidden, qkv, bias=False)
        self.proj = nn.Linear(hidden, hidden, bias=False)
        self.fc1 = nn.Linear(hidden, 2 * ffn, bias=False)
        self.fc2 = nn.Linear(ffn, hidden, bias=False)
        for w in (self.qkv, self.proj, self.fc1, self.fc2):
            nn.init.normal_(w.weight, std=0.02)
        self.backend = backend

    def _attention(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        s, b, _ = x.shape
        per_group, d = self.heads // self.kv_heads, self.head_dim
        mixed = self.qkv(self.norm1(x)).view(s, b, self.kv_heads, (per_group + 2) * d)
        q, k, v = torch.split(mixed, [per_group * d, d, d], dim=3)  # megatron's per-group split
        q = _rope(q.reshape(s, b, self.heads, d), freqs)
        k = _rope(k, freqs)
        out = attention(*(t.permute(1, 0, 2, 3) for t in (q, k, v)), causal=True, backend=self.backend)
        return self.proj(out.permute(1, 0, 2, 3).reshape(s, b, self.heads * d))

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        x = x + self._attention(x, freqs)
        gate, linear = torch.chunk(self.fc1(self.norm2(x)), 2, dim=-1)
        return x + self.fc2(F.silu(gate) * (linear + 0.0))  # megatron adds glu_linear_offset (0)


class SavedStorages:
    """Unique storages autograd saves inside the context, weights left out."""

    def __init__(self, module: nn.Module):
        self.skip = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self.seen: dict[int, dict] = {}
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.skip and ptr not in self.seen:
            dtype = str(t.dtype).replace("torch.", "")
            self.seen[ptr] = {"bytes": storage.nbytes(), "dtype": dtype, "shape": list(t.shape)}
        return t

    def __enter__(self):
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)

    def total(self) -> int:
        return sum(s["bytes"] for s in self.seen.values())


def _allocated(device: torch.device) -> int | None:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def _peak_above(device: torch.device, base: int | None) -> int | None:
    return torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" and base is not None else None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _sync_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def measure(layer: LlamaLayer, tokens: int, hidden: int, device, dtype) -> dict:
    freqs = rope_freqs(tokens, layer.head_dim, device)
    x = torch.randn(tokens, 1, hidden, device=device, dtype=dtype, requires_grad=True)
    layer(x, freqs).float().pow(2).mean().backward()  # warm-up: weight grads exist, kernels chosen
    x.grad = None
    _sync_reset(device)
    before = _allocated(device)
    with SavedStorages(layer) as saved:
        out = layer(x, freqs)
    _sync(device)
    forward_peak = _peak_above(device, before)
    after = _allocated(device)
    dout = torch.randn_like(out)
    _sync_reset(device)
    base = _allocated(device)
    out.backward(dout)
    _sync(device)
    backward_peak = _peak_above(device, base)
    return {
        "tokens": tokens,
        "forward_delta_bytes": None if before is None else after - before,
        "saved_storage_bytes": saved.total(),
        "forward_peak_above_start_bytes": forward_peak,
        "backward_peak_above_start_bytes": backward_peak,
        "saved_storages": sorted(saved.seen.values(), key=lambda s: -s["bytes"]),
    }


def predictions(a, tokens: int, element_bytes: int) -> dict:
    def shape(impl: str) -> LayerShape:
        head_dim = a.hidden // a.heads
        return LayerShape(a.hidden, a.ffn, a.heads, a.kv_heads, head_dim, 0, 1, 1, False, 1, element_bytes, impl)

    return {
        "model_local_bytes": shape("local").activation_bytes(tokens),
        "model_te_bytes": shape("te").activation_bytes(tokens),
        "model_kv_bytes": shape("local").kv_bytes(tokens),
        "layer_output_bytes": tokens * a.hidden * element_bytes,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=11008)
    p.add_argument("--tokens", default="4096,16384,32768", help="comma-separated token counts (micro batch 1)")
    p.add_argument("--out", required=True, help="JSON file to write")
    a = p.parse_args()
    if a.hidden % a.heads or a.heads % a.kv_heads:
        p.error(
            f"--hidden {a.hidden} / --heads {a.heads} / --kv-heads {a.kv_heads}: allowed are --heads dividing "
            "--hidden and --kv-heads dividing --heads"
        )
    device = torch.device(a.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    choice = choose_backend(None, device, dtype)
    layer = LlamaLayer(a.hidden, a.heads, a.kv_heads, a.ffn, choice.backend).to(device=device, dtype=dtype)
    element_bytes = torch.finfo(dtype).bits // 8
    rows = []
    for tokens in (int(t) for t in a.tokens.split(",")):
        row = measure(layer, tokens, a.hidden, device, dtype) | predictions(a, tokens, element_bytes)
        rows.append(row)
        measured = row["forward_delta_bytes"] or row["saved_storage_bytes"]
        print(
            f"s={tokens:6d}  measured {measured / tokens:9.0f} B/token (delta {row['forward_delta_bytes']}, "
            f"saved {row['saved_storage_bytes'] / tokens:.0f})  model local+kv "
            f"{(row['model_local_bytes'] + row['model_kv_bytes']) / tokens:9.0f}  te+kv "
            f"{(row['model_te_bytes'] + row['model_kv_bytes']) / tokens:9.0f}  "
            f"bwd peak {row['backward_peak_above_start_bytes']}"
        )
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    shape = {k: getattr(a, k) for k in ("hidden", "heads", "kv_heads", "ffn")}
    result = {"device": name, "torch": torch.__version__, "dtype": str(dtype), "attention_backend": choice.name}
    Path(a.out).write_text(json.dumps(result | {"shape": shape, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
