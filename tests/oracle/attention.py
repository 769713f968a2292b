"""Independent float64 ground truth for attention: explicit mask, softmax, autograd."""

from __future__ import annotations

import os
import random

import torch


def fresh_seed() -> int:
    """A new seed per call (pin one with ATTN_TEST_SEED to reproduce a failure)."""
    pinned = os.environ.get("ATTN_TEST_SEED")
    return int(pinned) if pinned else random.SystemRandom().randrange(2**31)


def explicit_mask(sq: int, sk: int, causal: bool) -> torch.Tensor:
    """Bool [sq, sk], built entry by entry: row i sees key j iff j <= i + (sk - sq)."""
    mask = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        for i in range(sq):
            for j in range(sk):
                mask[i, j] = j <= i + (sk - sq)
    return mask


def naive_attention(q, k, v, causal: bool, scale: float | None = None):
    """Dense float64 attention -> (out [b, sq, hq, d], lse [b, hq, sq]); differentiable."""
    q, k, v = q.double(), k.double(), v.double()
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    scale = d**-0.5 if scale is None else scale
    k_rep = k.repeat_interleave(hq // hkv, dim=2)  # query head i -> kv head i // (hq // hkv)
    v_rep = v.repeat_interleave(hq // hkv, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k_rep) * scale
    scores = scores.masked_fill(~explicit_mask(sq, sk, causal).to(q.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v_rep), lse


def naive_varlen(q, k, v, q_lens, k_lens, causal: bool, scale: float | None = None):
    """Packed float64 attention -> (out [total_q, hq, d], lse [hq, total_q]), one sequence at a time."""
    outs, lses = [], []
    qs = ks = 0
    for lq, lk in zip(q_lens, k_lens):
        if lk == 0:  # no key: out 0, lse -inf
            outs.append(torch.zeros(lq, q.shape[1], v.shape[-1], dtype=torch.float64))
            lses.append(torch.full((q.shape[1], lq), float("-inf"), dtype=torch.float64))
        else:
            o, o_lse = naive_attention(
                q[qs : qs + lq].unsqueeze(0), k[ks : ks + lk].unsqueeze(0), v[ks : ks + lk].unsqueeze(0), causal, scale
            )
            outs.append(o[0])
            lses.append(o_lse[0])
        qs, ks = qs + lq, ks + lk
    return torch.cat(outs), torch.cat(lses, dim=1)


def naive_grads(q, k, v, dout, causal: bool, scale: float | None = None, varlen_lens=None):
    """(out, lse, dq, dk, dv) of the float64 naive attention via torch.autograd."""
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    if varlen_lens is None:
        out, lse = naive_attention(*leaves, causal, scale)
    else:
        out, lse = naive_varlen(*leaves, *varlen_lens, causal, scale)
    grads = torch.autograd.grad(out, leaves, dout.double(), allow_unused=True, materialize_grads=True)
    return (out.detach(), lse.detach(), *grads)


def cu_seqlens(lengths: list[int]) -> torch.Tensor:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32)


def assert_close(actual, expected, atol: float, rtol: float, what: str, seed: int) -> None:
    torch.testing.assert_close(
        actual.double(),
        expected.double(),
        atol=atol,
        rtol=rtol,
        equal_nan=False,
        msg=lambda m: f"{what} (seed {seed}): {m}",
    )


def library_reference_grads(q, k, v, dout, lengths=None):
    """(out, dq, dk, dv) of single-process causal attention in float64 through the library's own
    reference backend -- over the whole ``[b, s, h, d]`` sequence, or (``lengths``) over a packed
    ``[t, h, d]`` varlen batch: the whole-sequence answer that sharded and sliced attention must give
    (the naive functions above check that backend itself)."""
    from megatron_slim.runtime.attention import ReferenceBackend, attention, varlen_attention

    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    if lengths is None:
        out = attention(q, k, v, causal=True, backend=ReferenceBackend())
    else:
        cu = cu_seqlens(list(lengths))
        out = varlen_attention(q, k, v, cu, cu, max(lengths), max(lengths), causal=True, backend=ReferenceBackend())
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad
