"""Adapters over torch's fused attention ops that also return the log-sum-exp.

Each kernel takes our ``[b, s, h, d]`` layout and torch's *top-left* causal flag, and returns
(out, lse) / (dq, dk, dv); ``sdpa.py`` builds the bottom-right mask from them. Signatures are
those of torch 2.13 (``torch.ops.aten.<op>.default._schema``):

- CPU: ``_scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``): any float dtype,
  grouped-query heads handled natively, lse float32 (float64 for float64 inputs).
- CUDA fp16/bf16, head_dim <= 256: ``_scaled_dot_product_flash_attention`` (+ ``_backward``).
- CUDA otherwise: ``_scaled_dot_product_efficient_attention`` (+ ``_backward``), whose lse is
  padded to a multiple of 32 rows.
The CUDA kernels need equal q/kv head counts and head_dim a multiple of 8, so K/V heads are
repeated (their gradients summed back) and head_dim is zero-padded.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

Tensor = torch.Tensor
aten = torch.ops.aten

CPU_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
CUDA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FLASH_MAX_HEAD_DIM = 256
_EFFICIENT_LSE_ROWS = 32


def _bhsd(x: Tensor) -> Tensor:
    return x.transpose(1, 2)


class CpuKernels:
    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            _bhsd(q), _bhsd(k), _bhsd(v), 0.0, causal, scale=scale
        )
        return _bhsd(out), lse.float()

    def backward(self, dout, q, k, v, out, lse, causal: bool, scale: float):
        lse = lse.to(torch.promote_types(q.dtype, torch.float32)).contiguous()
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), lse, 0.0, causal, scale=scale
        )
        return _bhsd(dq), _bhsd(dk), _bhsd(dv)


def _pad_head_dim(x: Tensor) -> Tensor:
    pad = (-x.shape[-1]) % 8
    return F.pad(x, (0, pad)) if pad else x


def _to_cuda_layout(x: Tensor, repeat: int = 1) -> Tensor:
    """``[b, s, h, d]`` -> ``[b, h*repeat, s, d_padded]`` (kv head h serves query heads h*g..h*g+g-1)."""
    if repeat > 1:
        x = x.repeat_interleave(repeat, dim=2)
    return _bhsd(_pad_head_dim(x))


def _from_cuda_layout(x: Tensor, head_dim: int, groups: int = 1) -> Tensor:
    """Inverse of ``_to_cuda_layout``; sums the gradients of repeated kv heads."""
    x = _bhsd(x)[..., :head_dim]
    if groups > 1:
        b, s, h, d = x.shape
        x = x.float().reshape(b, s, h // groups, groups, d).sum(3)
    return x


class _CudaKernels:
    """Shared plumbing; subclasses call one torch op pair on the prepared tensors."""

    def _fwd(self, q, k, v, causal, scale):
        raise NotImplementedError

    def _bwd(self, dout, q, k, v, out, lse, causal, scale):
        raise NotImplementedError

    def forward(self, q, k, v, causal, scale):
        g = q.shape[2] // k.shape[2]
        out, lse = self._fwd(_to_cuda_layout(q), _to_cuda_layout(k, g), _to_cuda_layout(v, g), causal, scale)
        return _from_cuda_layout(out, v.shape[-1]), lse[..., : q.shape[1]].float()

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        g = q.shape[2] // k.shape[2]
        dq, dk, dv = self._bwd(
            _to_cuda_layout(dout),
            _to_cuda_layout(q),
            _to_cuda_layout(k, g),
            _to_cuda_layout(v, g),
            _to_cuda_layout(out),
            lse.float().contiguous(),
            causal,
            scale,
        )
        d, dv_dim = q.shape[-1], v.shape[-1]
        return (
            _from_cuda_layout(dq, d).to(q.dtype),
            _from_cuda_layout(dk, d, g).to(k.dtype),
            _from_cuda_layout(dv, dv_dim, g).to(v.dtype),
        )


class CudaFlashKernels(_CudaKernels):
    def _fwd(self, q, k, v, causal, scale):
        res = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return res[0], res[1]

    def _bwd(self, dout, q, k, v, out, lse, causal, scale):
        # Without dropout the RNG state is never read; placeholders of the forward's shapes.
        seed = torch.empty(2, dtype=torch.uint64, device=q.device)
        offset = torch.empty((), dtype=torch.uint64, device=q.device)
        return aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, seed, offset, scale=scale
        )


class CudaEfficientKernels(_CudaKernels):
    def _fwd(self, q, k, v, causal, scale):
        out, lse, _, _ = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
        return out, lse

    def _bwd(self, dout, q, k, v, out, lse, causal, scale):
        sq = q.shape[2]
        rows = math.ceil(sq / _EFFICIENT_LSE_ROWS) * _EFFICIENT_LSE_ROWS
        lse = F.pad(lse, (0, rows - sq))  # the kernel expects the forward's padded lse
        seed = torch.empty((), dtype=torch.long, device=q.device)
        offset = torch.empty((), dtype=torch.long, device=q.device)
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False], causal, scale=scale
        )
        return dq, dk, dv


def kernels_for(device: torch.device, dtype: torch.dtype, head_dim: int):
    if device.type == "cpu":
        return CpuKernels()
    if dtype in (torch.float16, torch.bfloat16) and head_dim <= _FLASH_MAX_HEAD_DIM:
        return CudaFlashKernels()
    return CudaEfficientKernels()
