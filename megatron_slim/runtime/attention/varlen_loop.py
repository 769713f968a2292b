"""Packed (varlen) attention as a loop of dense calls, one sequence at a time.

Good enough for backends without a packed kernel (torch SDPA, the reference): it syncs once
to read the boundaries and launches one dense call per non-empty sequence.
"""

from __future__ import annotations

from typing import Callable

import torch

from megatron_slim.runtime.attention.checks import check_varlen, varlen_lengths

Tensor = torch.Tensor


def varlen_forward(
    dense_forward: Callable[..., tuple[Tensor, Tensor]],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    *,
    causal: bool,
    softmax_scale: float | None,
) -> tuple[Tensor, Tensor]:
    check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k)
    cq, ck = varlen_lengths(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], causal)
    total_q, hq = q.shape[0], q.shape[1]
    out = q.new_zeros(total_q, hq, v.shape[-1])
    # Rows that see no key (a sequence with no keys, non-causal) keep out = 0, lse = -inf.
    lse = torch.full((hq, total_q), float("-inf"), dtype=torch.float32, device=q.device)
    for i in range(len(cq) - 1):
        qs, qe, ks, ke = cq[i], cq[i + 1], ck[i], ck[i + 1]
        if qe == qs or ke == ks:
            continue
        o_i, lse_i = dense_forward(
            q[qs:qe].unsqueeze(0),
            k[ks:ke].unsqueeze(0),
            v[ks:ke].unsqueeze(0),
            causal=causal,
            softmax_scale=softmax_scale,
        )
        out[qs:qe] = o_i[0]
        lse[:, qs:qe] = lse_i[0]
    return out, lse


def varlen_backward(
    dense_backward: Callable[..., tuple[Tensor, Tensor, Tensor]],
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    *,
    causal: bool,
    softmax_scale: float | None,
) -> tuple[Tensor, Tensor, Tensor]:
    check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k)
    cq, ck = varlen_lengths(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], causal)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for i in range(len(cq) - 1):
        qs, qe, ks, ke = cq[i], cq[i + 1], ck[i], ck[i + 1]
        if qe == qs or ke == ks:
            continue
        dq_i, dk_i, dv_i = dense_backward(
            dout[qs:qe].unsqueeze(0),
            q[qs:qe].unsqueeze(0),
            k[ks:ke].unsqueeze(0),
            v[ks:ke].unsqueeze(0),
            out[qs:qe].unsqueeze(0),
            lse[:, qs:qe].unsqueeze(0).contiguous(),
            causal=causal,
            softmax_scale=softmax_scale,
        )
        dq[qs:qe] = dq_i[0]
        dk[ks:ke] = dk_i[0]
        dv[ks:ke] = dv_i[0]
    return dq, dk, dv
