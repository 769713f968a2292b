"""The one shape every attention kernel has.

A backend turns (q, k, v) into (out, lse) and, given the upstream gradient plus the saved
out and lse, into (dq, dk, dv). ``backward`` takes ``out`` and ``lse`` as inputs instead of
recomputing them, because callers that split keys into blocks (K/V-cached slices,
context-parallel rings) pass the *final merged* out and lse for each block: with the global
softmax statistics, every block's gradient is exact and the per-block dq simply add up.
"""

from __future__ import annotations

import abc

import torch

from megatron_slim.runtime.attention import varlen_loop

Tensor = torch.Tensor


class AttentionBackend(abc.ABC):
    """Base class of all backends; see the package docstring for the tensor layouts.

    ``varlen_*`` default to a per-sequence loop over the dense kernels; backends with a
    native packed kernel override them.
    """

    name: str = "?"

    @abc.abstractmethod
    def unsupported_reason(self, device: torch.device, dtype: torch.dtype | None = None) -> str | None:
        """``None`` when this backend can run on ``device`` with ``dtype``, else a short reason."""

    @abc.abstractmethod
    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, softmax_scale: float | None = None
    ) -> tuple[Tensor, Tensor]:
        """q ``[b, sq, hq, d]``, k/v ``[b, sk, hkv, d]`` -> out ``[b, sq, hq, d]``, lse ``[b, hq, sq]`` fp32."""

    @abc.abstractmethod
    def backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        *,
        causal: bool,
        softmax_scale: float | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Gradients in the input dtypes; dk/dv summed over the query heads sharing a kv head."""

    def varlen_forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        cu_seqlens_q: Tensor,
        cu_seqlens_k: Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        *,
        causal: bool,
        softmax_scale: float | None = None,
    ) -> tuple[Tensor, Tensor]:
        """q ``[total_q, hq, d]``, k/v ``[total_k, hkv, d]`` -> out ``[total_q, hq, d]``, lse ``[hq, total_q]``."""
        sequences = varlen_loop.nonempty_sequence_rows(q, k, v, cu_seqlens_q, cu_seqlens_k, causal)
        total_q, hq = q.shape[0], q.shape[1]
        out = q.new_zeros(total_q, hq, v.shape[-1])
        # Rows that see no key (a sequence with no keys, non-causal) keep out = 0, lse = -inf.
        lse = torch.full((hq, total_q), float("-inf"), dtype=torch.float32, device=q.device)
        for rq, rk in sequences:
            o_i, lse_i = self.forward(
                q[rq].unsqueeze(0), k[rk].unsqueeze(0), v[rk].unsqueeze(0), causal=causal, softmax_scale=softmax_scale
            )
            out[rq] = o_i[0]
            lse[:, rq] = lse_i[0]
        return out, lse

    def varlen_backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        cu_seqlens_q: Tensor,
        cu_seqlens_k: Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        *,
        causal: bool,
        softmax_scale: float | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        sequences = varlen_loop.nonempty_sequence_rows(q, k, v, cu_seqlens_q, cu_seqlens_k, causal)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for rq, rk in sequences:
            dq_i, dk_i, dv_i = self.backward(
                dout[rq].unsqueeze(0),
                q[rq].unsqueeze(0),
                k[rk].unsqueeze(0),
                v[rk].unsqueeze(0),
                out[rq].unsqueeze(0),
                lse[:, rq].unsqueeze(0).contiguous(),
                causal=causal,
                softmax_scale=softmax_scale,
            )
            dq[rq] = dq_i[0]
            dk[rk] = dk_i[0]
            dv[rk] = dv_i[0]
        return dq, dk, dv

    def __repr__(self) -> str:
        return f"<attention backend {self.name}>"
