"""What the fused CUDA fp16/bf16 backends (flash-attn, Transformer Engine) share.

Both validate the same way, answer empty inputs without launching a kernel (the kernels
reject zero-size tensors) and want head_dim zero-padded to a multiple of 8. A subclass
supplies only the four kernel calls, on checked, non-empty inputs with a resolved scale.
"""

from __future__ import annotations

import abc

import torch
import torch.nn.functional as F

from megatron_slim.runtime.attention.backend import AttentionBackend
from megatron_slim.runtime.attention.checks import (
    check_dense,
    check_varlen,
    cuda_half_precision_reason,
    resolve_softmax_scale,
)

Tensor = torch.Tensor


def pad_head_dim(x: Tensor) -> Tensor:
    """``x`` with its last dim zero-padded to a multiple of 8, contiguous."""
    pad = (-x.shape[-1]) % 8
    return F.pad(x, (0, pad)) if pad else x.contiguous()


def _zero_grads(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


class CudaFusedBackend(AttentionBackend):
    max_head_dim: int | None = None

    def unsupported_reason(self, device: torch.device, dtype: torch.dtype | None = None) -> str | None:
        return cuda_half_precision_reason(device, dtype)

    def _check_inputs(self, q: Tensor) -> None:
        reason = self.unsupported_reason(q.device, q.dtype)
        if reason is None and self.max_head_dim is not None and q.shape[-1] > self.max_head_dim:
            reason = f"head_dim {q.shape[-1]} > {self.max_head_dim}"
        if reason is not None:
            raise ValueError(f"{self.name} attention backend cannot run these inputs: {reason}")

    def _scale(self, q: Tensor, softmax_scale: float | None) -> float:
        self._check_inputs(q)
        return resolve_softmax_scale(softmax_scale, q.shape[-1])

    # ---- the kernel calls a subclass supplies -----------------------------------------------------
    @abc.abstractmethod
    def _dense_forward(self, q, k, v, causal: bool, scale: float) -> tuple[Tensor, Tensor]: ...

    @abc.abstractmethod
    def _dense_backward(self, dout, q, k, v, out, lse, causal: bool, scale: float): ...

    @abc.abstractmethod
    def _varlen_forward(self, q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float): ...

    @abc.abstractmethod
    def _varlen_backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q: int, max_k: int, causal, scale): ...

    # ---- the backend interface --------------------------------------------------------------------
    def forward(self, q, k, v, *, causal, softmax_scale=None):
        check_dense(q, k, v, causal)
        scale = self._scale(q, softmax_scale)
        if q.numel() == 0 or k.numel() == 0:
            b, sq, hq, _ = q.shape
            return q.new_zeros(b, sq, hq, v.shape[-1]), q.new_full((b, hq, sq), float("-inf"), dtype=torch.float32)
        return self._dense_forward(q, k, v, causal, scale)

    def backward(self, dout, q, k, v, out, lse, *, causal, softmax_scale=None):
        check_dense(q, k, v, causal)
        scale = self._scale(q, softmax_scale)
        if q.numel() == 0 or k.numel() == 0:
            return _zero_grads(q, k, v)
        return self._dense_backward(dout, q, k, v, out, lse, causal, scale)

    def varlen_forward(
        self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal, softmax_scale=None
    ):
        check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k)
        scale = self._scale(q, softmax_scale)
        if q.numel() == 0:
            return q.new_zeros(*q.shape[:2], v.shape[-1]), q.new_empty((q.shape[1], 0), dtype=torch.float32)
        lengths = (cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k))
        return self._varlen_forward(q, k, v, *lengths, causal, scale)

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
        scale = self._scale(q, softmax_scale)
        if q.numel() == 0:
            return _zero_grads(q, k, v)
        lengths = (cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k))
        return self._varlen_backward(dout, q, k, v, out, lse, *lengths, causal, scale)
