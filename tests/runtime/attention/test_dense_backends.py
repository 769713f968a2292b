"""Every backend runnable here against the float64 naive attention: out, lse, dq, dk, dv."""

import pytest
import torch

from megatron_slim.runtime.attention import ReferenceBackend, SdpaBackend
from tests.oracle.attention import assert_close, fresh_seed, naive_grads

BACKENDS = {"reference": ReferenceBackend(), "sdpa": SdpaBackend()}

# (batch, sq, sk, hq, hkv, head_dim, causal)
CASES = [
    (2, 7, 7, 4, 2, 8, True),  # GQA, ordinary causal, odd length
    (2, 7, 13, 4, 2, 8, True),  # GQA, bottom-right causal, sq < sk
    (1, 13, 13, 4, 4, 16, False),  # MHA, full
    (2, 7, 13, 4, 2, 8, False),  # GQA, full, sq < sk
    (2, 5, 13, 3, 3, 5, True),  # odd head dim, bottom-right
    (1, 1, 9, 4, 1, 8, True),  # one query at the end of 9 keys, multi-query
    (1, 13, 13, 4, 2, 8, True),  # odd square causal
]

# dtype -> (atol, rtol) for out and grads, atol for lse. float32 errors are ~1e-6 in practice;
# bf16 results are rounded to 8 mantissa bits (relative 4e-3) and the kernels round P to bf16.
TOLERANCES = {
    torch.float64: (1e-6, 1e-6, 1e-6),  # lse is returned in float32
    torch.float32: (2e-5, 2e-4, 1e-5),
    torch.bfloat16: (3e-2, 3e-2, 2e-2),
}


def _inputs(case, dtype, seed):
    b, sq, sk, hq, hkv, d, _ = case
    gen = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=gen).to(dtype)  # noqa: E731
    return make(b, sq, hq, d), make(b, sk, hkv, d), make(b, sk, hkv, d), make(b, sq, hq, d)


def _case_id(c):
    return "b{}_sq{}_sk{}_h{}-{}_d{}_{}".format(*c[:6], "causal" if c[6] else "full")


@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_backend_matches_float64_naive(name, dtype, case):
    backend, causal, seed = BACKENDS[name], case[6], fresh_seed()
    q, k, v, dout = _inputs(case, dtype, seed)
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = naive_grads(q, k, v, dout, causal)
    atol, rtol, lse_atol = TOLERANCES[dtype]

    out, lse = backend.forward(q, k, v, causal=causal)
    assert out.dtype == dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    assert_close(out, ref_out, atol, rtol, f"{name} out", seed)
    assert_close(lse, ref_lse, lse_atol, 0, f"{name} lse", seed)

    dq, dk, dv = backend.backward(dout, q, k, v, out, lse, causal=causal)
    assert (dq.dtype, dk.dtype, dv.dtype) == (dtype, dtype, dtype)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert_close(dq, ref_dq, atol, rtol, f"{name} dq", seed)
    assert_close(dk, ref_dk, atol, rtol, f"{name} dk", seed)
    assert_close(dv, ref_dv, atol, rtol, f"{name} dv", seed)


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_explicit_softmax_scale(name):
    seed = fresh_seed()
    case = (1, 5, 9, 2, 1, 8, True)
    q, k, v, dout = _inputs(case, torch.float32, seed)
    ref = naive_grads(q, k, v, dout, True, scale=0.2)
    out, lse = BACKENDS[name].forward(q, k, v, causal=True, softmax_scale=0.2)
    grads = BACKENDS[name].backward(dout, q, k, v, out, lse, causal=True, softmax_scale=0.2)
    for got, want, what in zip((out, lse, *grads), ref, ("out", "lse", "dq", "dk", "dv")):
        assert_close(got, want, 2e-5, 2e-4, f"{name} {what}", seed)


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_backward_over_key_blocks_with_merged_stats_sums_to_full_gradients(name):
    """What K/V-cached slices rely on: per-block backward against the final out/lse is exact."""
    seed = fresh_seed()
    case = (2, 6, 15, 4, 2, 8, True)
    q, k, v, dout = _inputs(case, torch.float64, seed)
    backend = BACKENDS[name]
    out, lse = backend.forward(q, k, v, causal=True)
    full = backend.backward(dout, q, k, v, out, lse, causal=True)
    split = 9  # keys [0, 9) are a full prefix for all 6 queries; [9, 15) is the causal diagonal
    dq_a, dk_a, dv_a = backend.backward(dout, q, k[:, :split], v[:, :split], out, lse, causal=False)
    dq_b, dk_b, dv_b = backend.backward(dout, q, k[:, split:], v[:, split:], out, lse, causal=True)
    assert_close(dq_a + dq_b, full[0], 1e-6, 1e-6, f"{name} dq", seed)
    assert_close(torch.cat([dk_a, dk_b], 1), full[1], 1e-6, 1e-6, f"{name} dk", seed)
    assert_close(torch.cat([dv_a, dv_b], 1), full[2], 1e-6, 1e-6, f"{name} dv", seed)


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_input_errors_name_the_problem(name):
    backend = BACKENDS[name]
    q = torch.randn(1, 5, 4, 8)
    kv = torch.randn(1, 3, 2, 8)
    with pytest.raises(ValueError, match="sq=5 > sk=3"):
        backend.forward(q, kv, kv, causal=True)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        backend.forward(q, torch.randn(1, 5, 3, 8), torch.randn(1, 5, 3, 8), causal=False)
    with pytest.raises(ValueError, match="expected 4 dims"):
        backend.forward(q[0], kv[0], kv[0], causal=False)
    with pytest.raises(ValueError, match="softmax_scale"):
        backend.forward(q, torch.randn(1, 5, 2, 8), torch.randn(1, 5, 2, 8), causal=True, softmax_scale=-1.0)


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_empty_query_and_empty_keys(name):
    backend = BACKENDS[name]
    out, lse = backend.forward(torch.randn(1, 0, 2, 8), torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8), causal=True)
    assert out.shape == (1, 0, 2, 8) and lse.shape == (1, 2, 0)
    q = torch.randn(1, 3, 2, 8)
    out, lse = backend.forward(q, torch.randn(1, 0, 2, 8), torch.randn(1, 0, 2, 8), causal=False)
    assert torch.equal(out, torch.zeros_like(q)) and bool(torch.isneginf(lse).all())
