"""Transformer Engine's fused (cuDNN) attention behind the backend interface.

Uses ``transformer_engine.pytorch.cpp_extensions.fused_attn.fused_attn_fwd/_bwd`` of
Transformer Engine >= 2.0 (``fake_dtype`` argument), F16_arbitrary_seqlen backend, layouts
``bshd_bshd_bshd`` (dense) and ``thd_thd_thd`` (varlen), causal as ``causal_bottom_right``.
The softmax statistics TE keeps for backward are exactly our lse: ``[b, h, sq, 1]`` for
dense; for thd, ``[total_q, h, 1]`` with cuDNN >= 9.6 and ``[b, h, max_seqlen_q, 1]`` before.
Backward rebuilds that list from the lse it is given (plus an unused RNG state: no dropout).

UNEXERCISED where no GPU and Transformer Engine are present; tests marked ``gpu`` cover it.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from typing import NamedTuple

import torch

from megatron_slim.runtime.attention.cuda_fused import CudaFusedBackend
from megatron_slim.runtime.attention.cuda_fused import pad_head_dim as _pad

Tensor = torch.Tensor


def _call(fn, **kwargs):
    accepted = set(inspect.signature(fn).parameters)
    return fn(**{name: value for name, value in kwargs.items() if name in accepted})


def _dense_cu_seqlens(batch: int, seqlen: int, device: torch.device) -> Tensor:
    return torch.arange(0, (batch + 1) * seqlen, seqlen, dtype=torch.int32, device=device)


def _token_index(cu_seqlens: Tensor, total: int) -> tuple[Tensor, Tensor]:
    """(sequence id, position in sequence) of every packed token."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths, output_size=total)
    pos = torch.arange(total, device=cu_seqlens.device) - cu_seqlens.long()[seq]
    return seq, pos


class _Layout(NamedTuple):
    """How one call lays out its sequences for fused_attn: lengths, boundaries, layout, mask."""

    max_q: int
    max_k: int
    cu_q: Tensor
    cu_k: Tensor
    qkv_layout: str
    mask: str

    @staticmethod
    def dense(q: Tensor, k: Tensor, causal: bool) -> _Layout:
        b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
        mask = "no_mask" if not causal else "causal" if sq == sk else "causal_bottom_right"
        cu_q, cu_k = _dense_cu_seqlens(b, sq, q.device), _dense_cu_seqlens(b, sk, q.device)
        return _Layout(sq, sk, cu_q, cu_k, "bshd_bshd_bshd", mask)

    @staticmethod
    def varlen(cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, causal: bool) -> _Layout:
        mask = "padding_causal_bottom_right" if causal else "padding"
        return _Layout(max_q, max_k, cu_q, cu_k, "thd_thd_thd", mask)


class TeBackend(CudaFusedBackend):
    name = "te"

    def __init__(self, fused_attn, tex, packed_thd_stats: bool):
        self._fa = fused_attn
        self._backend = fused_attn.FusedAttnBackend["F16_arbitrary_seqlen"]
        self._dqkv_dtype = {torch.float16: tex.DType.kFloat16, torch.bfloat16: tex.DType.kBFloat16}
        self._packed_thd_stats = packed_thd_stats

    def _shared_kwargs(self, q, k, v, layout: _Layout, scale: float) -> dict:
        """The arguments fused_attn_fwd and fused_attn_bwd take alike (no dropout, no bias)."""
        return dict(
            max_seqlen_q=layout.max_q,
            max_seqlen_kv=layout.max_k,
            cu_seqlens_q=layout.cu_q,
            cu_seqlens_kv=layout.cu_k,
            q=_pad(q),
            k=_pad(k),
            v=_pad(v),
            fake_dtype=q.dtype,
            fused_attention_backend=self._backend,
            cu_seqlens_q_padded=layout.cu_q,
            cu_seqlens_kv_padded=layout.cu_k,
            attn_scale=scale,
            dropout=0.0,
            qkv_layout=layout.qkv_layout,
            attn_bias_type="no_bias",
            attn_mask_type=layout.mask,
        )

    def _run_fwd(self, q, k, v, layout: _Layout, scale: float) -> tuple[Tensor, Tensor]:
        out, aux = _call(self._fa.fused_attn_fwd, is_training=True, **self._shared_kwargs(q, k, v, layout, scale))
        return out[..., : v.shape[-1]], aux[0]

    def _run_bwd(self, dout, q, k, v, out, stats, layout: _Layout, scale: float):
        rng_state = torch.zeros(2, dtype=torch.int64, device=q.device)
        grads = _call(
            self._fa.fused_attn_bwd,
            o=_pad(out),
            d_o=_pad(dout),
            dqkv_dtype=self._dqkv_dtype[q.dtype],
            aux_ctx_tensors=[stats, rng_state],
            **self._shared_kwargs(q, k, v, layout, scale),
        )
        d, d_v = q.shape[-1], v.shape[-1]
        return grads[0][..., :d], grads[1][..., :d], grads[2][..., :d_v]

    def _dense_forward(self, q, k, v, causal, scale):
        b, sq, hq, _ = q.shape
        out, stats = self._run_fwd(q, k, v, _Layout.dense(q, k, causal), scale)
        return out, stats.reshape(b, hq, sq).float()

    def _dense_backward(self, dout, q, k, v, out, lse, causal, scale):
        b, sq, hq, _ = q.shape
        stats = lse.float().reshape(b, hq, sq, 1).contiguous()
        return self._run_bwd(dout, q, k, v, out, stats, _Layout.dense(q, k, causal), scale)

    def _stats_to_lse(self, stats: Tensor, cu_q: Tensor, total_q: int) -> Tensor:
        if stats.dim() == 3:  # packed [total_q, h, 1]
            return stats[:total_q, :, 0].t().float().contiguous()
        seq, pos = _token_index(cu_q, total_q)  # padded [b, h, max_seqlen_q, 1]
        return stats[seq, :, pos, 0].t().float().contiguous()

    def _lse_to_stats(self, lse: Tensor, cu_q: Tensor, max_q: int) -> Tensor:
        hq, total_q = lse.shape
        if self._packed_thd_stats:
            return lse.t().float().reshape(total_q, hq, 1).contiguous()
        seq, pos = _token_index(cu_q, total_q)
        stats = lse.new_zeros(cu_q.numel() - 1, hq, max_q, 1, dtype=torch.float32)
        stats[seq, :, pos, 0] = lse.t().float()
        return stats

    def _varlen_forward(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        out, stats = self._run_fwd(q, k, v, _Layout.varlen(cu_q, cu_k, max_q, max_k, causal), scale)
        return out, self._stats_to_lse(stats, cu_q, q.shape[0])

    def _varlen_backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
        stats = self._lse_to_stats(lse, cu_q, max_q)
        return self._run_bwd(dout, q, k, v, out, stats, _Layout.varlen(cu_q, cu_k, max_q, max_k, causal), scale)


def _packed_thd_stats() -> bool:
    try:
        utils = importlib.import_module("transformer_engine.pytorch.utils")
        return tuple(utils.get_cudnn_version()) >= (9, 6, 0)
    except Exception:  # unknown: assume a current cuDNN
        return True


def load_te_backend(device: torch.device) -> tuple[TeBackend | None, str]:
    """(backend, why); backend None with the reason when Transformer Engine cannot be used."""
    if device.type != "cuda":
        installed = importlib.util.find_spec("transformer_engine") is not None
        if not installed:
            return None, "transformer-engine not installed"
        return None, f"transformer-engine needs CUDA (device is {device.type})"
    try:
        fused_attn = importlib.import_module("transformer_engine.pytorch.cpp_extensions.fused_attn")
        tex = importlib.import_module("transformer_engine_torch")
    except ModuleNotFoundError as exc:
        if (exc.name or "").startswith("transformer_engine"):
            return None, "transformer-engine not installed"
        return None, f"transformer-engine failed to import: {exc}"
    except Exception as exc:  # a broken install must not break backend selection
        return None, f"transformer-engine failed to import: {exc}"
    if "fake_dtype" not in inspect.signature(fused_attn.fused_attn_fwd).parameters:
        return None, "transformer-engine < 2.0 is not supported (fused_attn_fwd has no fake_dtype)"
    version = getattr(importlib.import_module("transformer_engine"), "__version__", "?")
    return TeBackend(fused_attn, tex, _packed_thd_stats()), f"transformer-engine {version}"
