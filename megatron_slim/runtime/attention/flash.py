"""flash-attn 2 / 3 behind the backend interface (CUDA, fp16/bf16, head_dim <= 256).

flash-attn's causal mask is bottom-right aligned since 2.1, grouped-query heads are native
(dk/dv come back per kv head), and varlen is a packed kernel. Two conventions differ from
ours and are converted here: head_dim must be a multiple of 8 (zero-padded), and a row that
sees no key has lse = +inf in flash-attn (so its backward exp(s - lse) is 0) versus -inf here.

UNEXERCISED where no GPU and flash-attn are present; tests marked ``gpu`` cover it.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from megatron_slim.runtime.attention import flash_api
from megatron_slim.runtime.attention.backend import AttentionBackend
from megatron_slim.runtime.attention.checks import (
    check_dense,
    check_varlen,
    cuda_half_precision_reason,
    resolve_softmax_scale,
)

Tensor = torch.Tensor
MAX_HEAD_DIM = 256


def _pad(x: Tensor) -> Tensor:
    pad = (-x.shape[-1]) % 8
    return F.pad(x, (0, pad)) if pad else x.contiguous()


def _lse_to_ours(lse: Tensor) -> Tensor:
    return torch.where(torch.isposinf(lse), torch.full_like(lse, float("-inf")), lse).float()


def _lse_to_flash(lse: Tensor) -> Tensor:
    return torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse).float().contiguous()


def _is_hopper(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] == 9


class FlashBackend(AttentionBackend):
    name = "flash"

    def __init__(self, api: flash_api.FlashApi):
        self.api = api

    def unsupported_reason(self, device: torch.device, dtype: torch.dtype | None = None) -> str | None:
        return cuda_half_precision_reason(device, dtype)

    def _check_inputs(self, q: Tensor) -> None:
        reason = self.unsupported_reason(q.device, q.dtype)
        if reason is None and q.shape[-1] > MAX_HEAD_DIM:
            reason = f"head_dim {q.shape[-1]} > {MAX_HEAD_DIM}"
        if reason is not None:
            raise ValueError(f"flash attention backend cannot run these inputs: {reason}")

    def forward(self, q, k, v, *, causal, softmax_scale=None):
        check_dense(q, k, v, causal)
        self._check_inputs(q)
        scale = resolve_softmax_scale(softmax_scale, q.shape[-1])
        if q.numel() == 0 or k.numel() == 0:
            b, sq, hq, _ = q.shape
            return q.new_zeros(b, sq, hq, v.shape[-1]), q.new_full((b, hq, sq), float("-inf"), dtype=torch.float32)
        out, lse = self.api.forward(_pad(q), _pad(k), _pad(v), causal, scale)
        return out[..., : v.shape[-1]], _lse_to_ours(lse)

    def backward(self, dout, q, k, v, out, lse, *, causal, softmax_scale=None):
        check_dense(q, k, v, causal)
        self._check_inputs(q)
        scale = resolve_softmax_scale(softmax_scale, q.shape[-1])
        if q.numel() == 0 or k.numel() == 0:
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        dq, dk, dv = self.api.backward(
            _pad(dout), _pad(q), _pad(k), _pad(v), _pad(out), _lse_to_flash(lse), causal, scale
        )
        d, d_v = q.shape[-1], v.shape[-1]
        return dq[..., :d], dk[..., :d], dv[..., :d_v]

    def varlen_forward(
        self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal, softmax_scale=None
    ):
        check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k)
        self._check_inputs(q)
        scale = resolve_softmax_scale(softmax_scale, q.shape[-1])
        if q.numel() == 0:
            return q.new_zeros(*q.shape[:2], v.shape[-1]), q.new_empty((q.shape[1], 0), dtype=torch.float32)
        out, lse = self.api.varlen_forward(
            _pad(q),
            _pad(k),
            _pad(v),
            cu_seqlens_q,
            cu_seqlens_k,
            int(max_seqlen_q),
            int(max_seqlen_k),
            causal,
            scale,
        )
        return out[..., : v.shape[-1]], _lse_to_ours(lse)

    def varlen_backward(
        self,
        dout,
        q,
        k,
        v,
        out,
        lse,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        *,
        causal,
        softmax_scale=None,
    ):
        check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k)
        self._check_inputs(q)
        scale = resolve_softmax_scale(softmax_scale, q.shape[-1])
        if q.numel() == 0:
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        dq, dk, dv = self.api.varlen_backward(
            _pad(dout),
            _pad(q),
            _pad(k),
            _pad(v),
            _pad(out),
            _lse_to_flash(lse),
            cu_seqlens_q,
            cu_seqlens_k,
            int(max_seqlen_q),
            int(max_seqlen_k),
            causal,
            scale,
        )
        d, d_v = q.shape[-1], v.shape[-1]
        return dq[..., :d], dk[..., :d], dv[..., :d_v]


def load_flash_backend(device: torch.device) -> tuple[FlashBackend | None, str]:
    """(backend, why); backend None with the reason when flash-attn cannot be used on ``device``."""
    if device.type != "cuda":
        installed = any(importlib.util.find_spec(m) is not None for m in ("flash_attn", "flash_attn_interface"))
        return None, (f"flash-attn needs CUDA (device is {device.type})" if installed else "flash-attn not installed")
    api, why = flash_api.load(prefer_fa3=_is_hopper(device))
    return (FlashBackend(api), why) if api is not None else (None, why)
