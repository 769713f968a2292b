"""torch's fused SDPA kernels (CPU and CUDA) behind the backend interface.

torch's ``is_causal`` is top-left aligned; our causal mask is bottom-right aligned. For
``sq < sk`` the keys are split into a prefix of ``sk - sq`` keys that every query row sees
in full and a square diagonal block of the last ``sq`` keys where top-left == bottom-right
causal; the two partials are merged by log-sum-exp. The backward differentiates each block
against the merged out/lse, so dq adds up and dk/dv concatenate.
"""

from __future__ import annotations

import torch

from megatron_slim.runtime.attention.backend import AttentionBackend
from megatron_slim.runtime.attention.checks import check_dense, resolve_softmax_scale
from megatron_slim.runtime.attention.merge import merge
from megatron_slim.runtime.attention.sdpa_kernels import CPU_DTYPES, CUDA_DTYPES, kernels_for


def _empty_result(q: torch.Tensor, v: torch.Tensor):
    """Rows that see no key: out = 0, lse = -inf (also covers zero-size inputs)."""
    b, sq, hq, _ = q.shape
    out = q.new_zeros(b, sq, hq, v.shape[-1])
    lse = torch.full((b, hq, sq), float("-inf"), dtype=torch.float32, device=q.device)
    return out, lse


def _is_empty(q: torch.Tensor, k: torch.Tensor) -> bool:
    # torch's CPU kernel crashes the process (SIGFPE) on zero-length sequences.
    return q.numel() == 0 or k.numel() == 0


class SdpaBackend(AttentionBackend):
    name = "sdpa"

    def unsupported_reason(self, device: torch.device, dtype: torch.dtype | None = None) -> str | None:
        allowed = {"cpu": CPU_DTYPES, "cuda": CUDA_DTYPES}.get(device.type)
        if allowed is None:
            return f"device type {device.type!r} is not cpu or cuda"
        if dtype is not None and dtype not in allowed:
            return f"dtype {dtype} is not one of {[str(d) for d in allowed]} on {device.type}"
        return None

    def _kernels(self, q: torch.Tensor):
        reason = self.unsupported_reason(q.device, q.dtype)
        if reason is not None:
            raise ValueError(f"sdpa attention backend cannot run these inputs: {reason}")
        return kernels_for(q.device, q.dtype, q.shape[-1])

    def forward(self, q, k, v, *, causal, softmax_scale=None):
        check_dense(q, k, v, causal)
        scale = resolve_softmax_scale(softmax_scale, q.shape[-1])
        kern = self._kernels(q)
        if _is_empty(q, k):
            return _empty_result(q, v)
        sq, sk = q.shape[1], k.shape[1]
        if not causal or sq == sk:
            return kern.forward(q, k, v, causal, scale)
        p = sk - sq
        out_prefix, lse_prefix = kern.forward(q, k[:, :p], v[:, :p], False, scale)
        out_diag, lse_diag = kern.forward(q, k[:, p:], v[:, p:], True, scale)
        return merge(out_prefix, lse_prefix, out_diag, lse_diag)

    def backward(self, dout, q, k, v, out, lse, *, causal, softmax_scale=None):
        check_dense(q, k, v, causal)
        scale = resolve_softmax_scale(softmax_scale, q.shape[-1])
        kern = self._kernels(q)
        if _is_empty(q, k):
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        sq, sk = q.shape[1], k.shape[1]
        if not causal or sq == sk:
            dq, dk, dv = kern.backward(dout, q, k, v, out, lse, causal, scale)
            return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
        p = sk - sq
        dq_a, dk_a, dv_a = kern.backward(dout, q, k[:, :p], v[:, :p], out, lse, False, scale)
        dq_b, dk_b, dv_b = kern.backward(dout, q, k[:, p:], v[:, p:], out, lse, True, scale)
        acc = torch.promote_types(q.dtype, torch.float32)
        dq = (dq_a.to(acc) + dq_b.to(acc)).to(q.dtype)
        return dq, torch.cat([dk_a, dk_b], dim=1).to(k.dtype), torch.cat([dv_a, dv_b], dim=1).to(v.dtype)
