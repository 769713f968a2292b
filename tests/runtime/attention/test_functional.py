"""The autograd wrappers: gradients equal torch.autograd through the float64 naive attention."""

import pytest
import torch

from megatron_slim.runtime.attention import ReferenceBackend, attention, varlen_attention
from tests.oracle.attention import assert_close, cu_seqlens, fresh_seed, naive_attention, naive_varlen

# float32 wrappers vs float64 autograd: ~1e-6 observed; float64 wrappers are limited by the
# float32 lse of the contract (~1e-7 relative).
TOL = {torch.float32: (2e-5, 2e-4), torch.float64: (1e-6, 1e-6)}


def _leaves(seed, dtype, *shapes):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=gen).to(dtype).requires_grad_(True) for s in shapes]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("backend", ["sdpa", "reference", None])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_attention_gradients_match_autograd_of_naive(backend, dtype, causal):
    seed = fresh_seed()
    q, k, v = _leaves(seed, dtype, (2, 5, 4, 8), (2, 11, 2, 8), (2, 11, 2, 8))
    weight = torch.randn(2, 5, 4, 8, generator=torch.Generator().manual_seed(seed + 1), dtype=dtype)

    out, lse = attention(q, k, v, causal=causal, backend=backend, return_lse=True)
    assert not lse.requires_grad
    grads = torch.autograd.grad((out * weight).sum(), (q, k, v))

    leaves64 = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    ref_out, ref_lse = naive_attention(*leaves64, causal)
    ref_grads = torch.autograd.grad((ref_out * weight.double()).sum(), leaves64)

    atol, rtol = TOL[dtype]
    assert_close(out, ref_out, atol, rtol, "out", seed)
    assert_close(lse, ref_lse, 1e-5, 0, "lse", seed)
    for got, want, what in zip(grads, ref_grads, ("dq", "dk", "dv")):
        assert_close(got, want, atol, rtol, what, seed)


def test_attention_accepts_a_backend_instance_and_returns_only_out_by_default():
    q, k, v = _leaves(fresh_seed(), torch.float32, (1, 3, 2, 4), (1, 3, 2, 4), (1, 3, 2, 4))
    out = attention(q, k, v, backend=ReferenceBackend())
    assert isinstance(out, torch.Tensor) and out.requires_grad


@pytest.mark.parametrize("backend", ["sdpa", "reference"])
def test_varlen_attention_gradients_match_autograd_of_naive(backend):
    seed = fresh_seed()
    q_lens, k_lens = [1, 7, 0, 3], [2, 9, 4, 3]
    q, k, v = _leaves(seed, torch.float32, (sum(q_lens), 4, 8), (sum(k_lens), 2, 8), (sum(k_lens), 2, 8))
    weight = torch.randn(sum(q_lens), 4, 8, generator=torch.Generator().manual_seed(seed + 1))

    out = varlen_attention(
        q, k, v, cu_seqlens(q_lens), cu_seqlens(k_lens), max(q_lens), max(k_lens), causal=True, backend=backend
    )
    grads = torch.autograd.grad((out * weight).sum(), (q, k, v))

    leaves64 = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    ref_out, _ = naive_varlen(*leaves64, q_lens, k_lens, True)
    ref_grads = torch.autograd.grad((ref_out * weight.double()).sum(), leaves64)
    assert_close(out, ref_out, 2e-5, 2e-4, "out", seed)
    for got, want, what in zip(grads, ref_grads, ("dq", "dk", "dv")):
        assert_close(got, want, 2e-5, 2e-4, what, seed)
