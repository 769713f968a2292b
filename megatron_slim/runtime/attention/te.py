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


def _pad(x: Tensor) -> Tensor:
    pad = (-x.shape[-1]) % 8
    return F.pad(x, (0, pad)) if pad else x.contiguous()


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


class TeBackend(AttentionBackend):
    name = "te"

    def __init__(self, fused_attn, tex, packed_thd_stats: bool):
        self._fa = fused_attn
        self._backend = fused_attn.FusedAttnBackend["F16_arbitrary_seqlen"]
        self._dqkv_dtype = {torch.float16: tex.DType.kFloat16, torch.bfloat16: tex.DType.kBFloat16}
        self._packed_thd_stats = packed_thd_stats

    def unsupported_reason(self, device: torch.device, dtype: torch.dtype | None = None) -> str | None:
        return cuda_half_precision_reason(device, dtype)

    def _check_inputs(self, q: Tensor) -> None:
        reason = self.unsupported_reason(q.device, q.dtype)
        if reason is not None:
            raise ValueError(f"te attention backend cannot run these inputs: {reason}")

    def _run_fwd(self, q, k, v, max_q, max_k, cu_q, cu_k, layout, mask, scale):
        out, aux = _call(
            self._fa.fused_attn_fwd,
            is_training=True,
            max_seqlen_q=max_q,
            max_seqlen_kv=max_k,
            cu_seqlens_q=cu_q,
            cu_seqlens_kv=cu_k,
            q=_pad(q),
            k=_pad(k),
            v=_pad(v),
            fake_dtype=q.dtype,
            fused_attention_backend=self._backend,
            cu_seqlens_q_padded=cu_q,
            cu_seqlens_kv_padded=cu_k,
            attn_scale=scale,
            dropout=0.0,
            qkv_layout=layout,
            attn_bias_type="no_bias",
            attn_mask_type=mask,
        )
        return out[..., : v.shape[-1]], aux[0]

    def _run_bwd(self, dout, q, k, v, out, stats, max_q, max_k, cu_q, cu_k, layout, mask, scale):
        rng_state = torch.zeros(2, dtype=torch.int64, device=q.device)
        grads = _call(
            self._fa.fused_attn_bwd,
            max_seqlen_q=max_q,
            max_seqlen_kv=max_k,
            cu_seqlens_q=cu_q,
            cu_seqlens_kv=cu_k,
            q=_pad(q),
            k=_pad(k),
            v=_pad(v),
            o=_pad(out),
            d_o=_pad(dout),
            fake_dtype=q.dtype,
            dqkv_dtype=self._dqkv_dtype[q.dtype],
            aux_ctx_tensors=[stats, rng_state],
            fused_attention_backend=self._backend,
            cu_seqlens_q_padded=cu_q,
            cu_seqlens_kv_padded=cu_k,
            attn_scale=scale,
            dropout=0.0,
            qkv_layout=layout,
            attn_bias_type="no_bias",
            attn_mask_type=mask,
        )
        d, d_v = q.shape[-1], v.shape[-1]
        return grads[0][..., :d], grads[1][..., :d], grads[2][..., :d_v]

    @staticmethod
    def _dense_mask(causal: bool, sq: int, sk: int) -> str:
        if not causal:
            return "no_mask"
        return "causal" if sq == sk else "causal_bottom_right"

    def forward(self, q, k, v, *, causal, softmax_scale=None):
        check_dense(q, k, v, causal)
        self._check_inputs(q)
        scale = resolve_softmax_scale(softmax_scale, q.shape[-1])
        b, sq, hq, _ = q.shape
        sk = k.shape[1]
        if q.numel() == 0 or k.numel() == 0:
            return q.new_zeros(b, sq, hq, v.shape[-1]), q.new_full((b, hq, sq), float("-inf"), dtype=torch.float32)
        out, stats = self._run_fwd(
            q,
            k,
            v,
            sq,
            sk,
            _dense_cu_seqlens(b, sq, q.device),
            _dense_cu_seqlens(b, sk, q.device),
            "bshd_bshd_bshd",
            self._dense_mask(causal, sq, sk),
            scale,
        )
        return out, stats.reshape(b, hq, sq).float()

    def backward(self, dout, q, k, v, out, lse, *, causal, softmax_scale=None):
        check_dense(q, k, v, causal)
        self._check_inputs(q)
        scale = resolve_softmax_scale(softmax_scale, q.shape[-1])
        b, sq, hq, _ = q.shape
        sk = k.shape[1]
        if q.numel() == 0 or k.numel() == 0:
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        stats = lse.float().reshape(b, hq, sq, 1).contiguous()
        return self._run_bwd(
            dout,
            q,
            k,
            v,
            out,
            stats,
            sq,
            sk,
            _dense_cu_seqlens(b, sq, q.device),
            _dense_cu_seqlens(b, sk, q.device),
            "bshd_bshd_bshd",
            self._dense_mask(causal, sq, sk),
            scale,
        )

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

    def varlen_forward(
        self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal, softmax_scale=None
    ):
        check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k)
        self._check_inputs(q)
        scale = resolve_softmax_scale(softmax_scale, q.shape[-1])
        if q.numel() == 0:
            return q.new_zeros(*q.shape[:2], v.shape[-1]), q.new_empty((q.shape[1], 0), dtype=torch.float32)
        mask = "padding_causal_bottom_right" if causal else "padding"
        out, stats = self._run_fwd(
            q, k, v, int(max_seqlen_q), int(max_seqlen_k), cu_seqlens_q, cu_seqlens_k, "thd_thd_thd", mask, scale
        )
        return out, self._stats_to_lse(stats, cu_seqlens_q, q.shape[0])

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
        mask = "padding_causal_bottom_right" if causal else "padding"
        stats = self._lse_to_stats(lse, cu_seqlens_q, int(max_seqlen_q))
        return self._run_bwd(
            dout,
            q,
            k,
            v,
            out,
            stats,
            int(max_seqlen_q),
            int(max_seqlen_k),
            cu_seqlens_q,
            cu_seqlens_k,
            "thd_thd_thd",
            mask,
            scale,
        )


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
