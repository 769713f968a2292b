"""Input validation shared by every attention backend.

Errors a caller can cause raise ``ValueError`` naming the bad input and what is allowed.
"""

from __future__ import annotations

import math

import torch


def resolve_softmax_scale(softmax_scale: float | None, head_dim: int) -> float:
    """``None`` means the usual ``1 / sqrt(head_dim)``."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    scale = float(softmax_scale)
    if not math.isfinite(scale) or scale <= 0.0:
        raise ValueError(f"softmax_scale={softmax_scale!r}: must be a positive finite number or None")
    return scale


def _check_common(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dim: int, layout: str) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != dim:
            raise ValueError(f"{name} has shape {tuple(t.shape)}: expected {dim} dims, layout {layout}")
        if not t.is_floating_point():
            raise ValueError(f"{name} has dtype {t.dtype}: expected a floating-point dtype")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}): they must be equal")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v devices differ ({q.device}, {k.device}, {v.device}): they must be equal")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree on all but the last dim")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q head dim {q.shape[-1]} != k head dim {k.shape[-1]}: they must be equal")
    hq, hkv = q.shape[-2], k.shape[-2]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"q has {hq} heads and k/v have {hkv}: q heads must be a positive multiple of kv heads")


def check_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> None:
    """q ``[b, sq, hq, d]``, k/v ``[b, sk, hkv, d]``; causal needs ``sq <= sk`` (bottom-right mask)."""
    _check_common(q, k, v, 4, "[batch, seq, heads, head_dim]")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q batch {q.shape[0]} != k/v batch {k.shape[0]}: they must be equal")
    sq, sk = q.shape[1], k.shape[1]
    if causal and sq > sk:
        raise ValueError(
            f"causal attention with sq={sq} > sk={sk}: the bottom-right causal mask needs sq <= sk "
            "(queries are the last sq positions of the key sequence)"
        )


def check_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
) -> None:
    """Shape-only checks (no device sync): q ``[total_q, hq, d]``, k/v ``[total_k, hkv, d]``."""
    _check_common(q, k, v, 3, "[total_tokens, heads, head_dim]")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dim() != 1 or cu.numel() < 1:
            raise ValueError(f"{name} has shape {tuple(cu.shape)}: expected 1-D of length nseq + 1")
        if cu.dtype != torch.int32:
            raise ValueError(f"{name} has dtype {cu.dtype}: expected torch.int32")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(
            f"cu_seqlens_q has {cu_seqlens_q.numel()} entries and cu_seqlens_k {cu_seqlens_k.numel()}: "
            "both must be nseq + 1"
        )


def varlen_lengths(
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, total_q: int, total_k: int, causal: bool
) -> tuple[list[int], list[int]]:
    """Host copies of the boundaries, validated (this syncs with the device)."""
    cq = [int(x) for x in cu_seqlens_q.tolist()]
    ck = [int(x) for x in cu_seqlens_k.tolist()]
    for name, cu, total in (("cu_seqlens_q", cq, total_q), ("cu_seqlens_k", ck, total_k)):
        if cu[0] != 0 or cu[-1] != total or any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"{name}={cu}: must start at 0, be non-decreasing and end at the token count {total}")
    if causal:
        for i in range(len(cq) - 1):
            sq, sk = cq[i + 1] - cq[i], ck[i + 1] - ck[i]
            if sq > sk:
                raise ValueError(
                    f"causal varlen attention: sequence {i} has {sq} query tokens > {sk} key tokens; "
                    "the bottom-right causal mask needs sq <= sk per sequence"
                )
    return cq, ck


def cuda_half_precision_reason(device: torch.device, dtype: torch.dtype | None) -> str | None:
    """Why a CUDA-only fp16/bf16 kernel (flash-attn, Transformer Engine) cannot run here, or None."""
    if device.type != "cuda":
        return f"needs a CUDA device, got {device.type}"
    if dtype is not None and dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {dtype} is not one of ['torch.float16', 'torch.bfloat16']"
    return None
