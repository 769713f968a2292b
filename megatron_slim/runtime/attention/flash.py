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

from megatron_slim.runtime.attention import flash_api
from megatron_slim.runtime.attention.cuda_fused import CudaFusedBackend
from megatron_slim.runtime.attention.cuda_fused import pad_head_dim as _pad

Tensor = torch.Tensor
MAX_HEAD_DIM = 256


def _lse_to_ours(lse: Tensor) -> Tensor:
    return torch.where(torch.isposinf(lse), torch.full_like(lse, float("-inf")), lse).float()


def _lse_to_flash(lse: Tensor) -> Tensor:
    return torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse).float().contiguous()


def _is_hopper(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] == 9


def _unpad_grads(grads, q: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = grads
    d, d_v = q.shape[-1], v.shape[-1]
    return dq[..., :d], dk[..., :d], dv[..., :d_v]


class FlashBackend(CudaFusedBackend):
    name = "flash"
    max_head_dim = MAX_HEAD_DIM

    def __init__(self, api: flash_api.FlashApi):
        self.api = api

    def _dense_forward(self, q, k, v, causal, scale):
        out, lse = self.api.forward(_pad(q), _pad(k), _pad(v), causal, scale)
        return out[..., : v.shape[-1]], _lse_to_ours(lse)

    def _dense_backward(self, dout, q, k, v, out, lse, causal, scale):
        padded = (_pad(dout), _pad(q), _pad(k), _pad(v), _pad(out), _lse_to_flash(lse))
        return _unpad_grads(self.api.backward(*padded, causal, scale), q, v)

    def _varlen_forward(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        out, lse = self.api.varlen_forward(_pad(q), _pad(k), _pad(v), cu_q, cu_k, max_q, max_k, causal, scale)
        return out[..., : v.shape[-1]], _lse_to_ours(lse)

    def _varlen_backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
        padded = (_pad(dout), _pad(q), _pad(k), _pad(v), _pad(out), _lse_to_flash(lse))
        return _unpad_grads(self.api.varlen_backward(*padded, cu_q, cu_k, max_q, max_k, causal, scale), q, v)


def load_flash_backend(device: torch.device) -> tuple[FlashBackend | None, str]:
    """(backend, why); backend None with the reason when flash-attn cannot be used on ``device``."""
    if device.type != "cuda":
        installed = any(importlib.util.find_spec(m) is not None for m in ("flash_attn", "flash_attn_interface"))
        return None, (f"flash-attn needs CUDA (device is {device.type})" if installed else "flash-attn not installed")
    api, why = flash_api.load(prefer_fa3=_is_hopper(device))
    return (FlashBackend(api), why) if api is not None else (None, why)
