"""Packed (varlen) attention of every backend runnable here against the float64 naive loop."""

import pytest
import torch

from megatron_slim.runtime.attention import ReferenceBackend, SdpaBackend
from tests.oracle.attention import assert_close, cu_seqlens, fresh_seed, naive_grads

BACKENDS = {"reference": ReferenceBackend(), "sdpa": SdpaBackend()}

# (query lengths, key lengths, causal)
CASES = [
    ([1, 7, 16, 3], [1, 7, 16, 3], True),  # self-attention, odd lengths
    ([1, 7, 16, 3], [4, 7, 21, 3], True),  # bottom-right per sequence (slices with a K/V prefix)
    ([0, 5, 0, 3], [2, 5, 4, 6], True),  # sequences without query tokens
    ([1, 7, 16, 3], [3, 1, 16, 8], False),  # full attention, unequal lengths
    ([2, 3], [0, 5], False),  # a sequence with queries but no keys: out 0, lse -inf
]
TOLERANCES = {torch.float32: (2e-5, 2e-4, 1e-5), torch.bfloat16: (3e-2, 3e-2, 2e-2)}


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"q{c[0]}_k{c[1]}_{'causal' if c[2] else 'full'}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_varlen_matches_float64_naive(name, dtype, case):
    q_lens, k_lens, causal = case
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    hq, hkv, d = 4, 2, 8
    tq, tk = sum(q_lens), sum(k_lens)
    q, dout = (torch.randn(tq, hq, d, generator=gen).to(dtype) for _ in range(2))
    k, v = (torch.randn(tk, hkv, d, generator=gen).to(dtype) for _ in range(2))
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = naive_grads(q, k, v, dout, causal, varlen_lens=(q_lens, k_lens))
    atol, rtol, lse_atol = TOLERANCES[dtype]
    backend = BACKENDS[name]
    cu_q, cu_k = cu_seqlens(q_lens), cu_seqlens(k_lens)

    out, lse = backend.varlen_forward(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), causal=causal)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (hq, tq) and lse.dtype == torch.float32
    assert_close(out, ref_out, atol, rtol, f"{name} out", seed)
    assert_close(lse, ref_lse, lse_atol, 0, f"{name} lse", seed)

    dq, dk, dv = backend.varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max(q_lens), max(k_lens), causal=causal)
    assert (dq.dtype, dk.dtype, dv.dtype) == (dtype, dtype, dtype)
    assert_close(dq, ref_dq, atol, rtol, f"{name} dq", seed)
    assert_close(dk, ref_dk, atol, rtol, f"{name} dk", seed)
    assert_close(dv, ref_dv, atol, rtol, f"{name} dv", seed)


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_varlen_input_errors(name):
    backend = BACKENDS[name]
    q, kv = torch.randn(8, 2, 4), torch.randn(8, 2, 4)
    with pytest.raises(ValueError, match="sequence 1 has 5 query tokens > 2 key tokens"):
        backend.varlen_forward(q, kv, kv, cu_seqlens([3, 5]), cu_seqlens([6, 2]), 5, 6, causal=True)
    with pytest.raises(ValueError, match="expected torch.int32"):
        backend.varlen_forward(q, kv, kv, cu_seqlens([8]).long(), cu_seqlens([8]), 8, 8, causal=True)
    with pytest.raises(ValueError, match="end at the token count 8"):
        backend.varlen_forward(q, kv, kv, cu_seqlens([7]), cu_seqlens([8]), 7, 8, causal=True)
    with pytest.raises(ValueError, match="both must be nseq \\+ 1"):
        backend.varlen_forward(q, kv, kv, cu_seqlens([4, 4]), cu_seqlens([8]), 4, 8, causal=False)
