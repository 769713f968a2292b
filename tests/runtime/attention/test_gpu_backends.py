"""CUDA backends (flash-attn, Transformer Engine, torch SDPA on CUDA) against the reference.

Skipped without a GPU; a backend that is not installed there is skipped, not failed.
"""

import pytest
import torch

from megatron_slim.runtime.attention import ReferenceBackend, select_backend
from tests.oracle.attention import cu_seqlens, fresh_seed

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# (batch, sq, sk, hq, hkv, head_dim, causal): the head dims kernels target (64, 128), one not a
# power of two (72) and one that must be zero-padded to a multiple of 8 (36).
DENSE = [
    (2, 128, 128, 8, 2, 64, True),
    (2, 77, 301, 8, 8, 128, True),  # bottom-right, odd lengths
    (1, 300, 300, 4, 1, 72, False),
    (2, 33, 97, 4, 2, 36, True),  # head dim not a multiple of 8
]
VARLEN = [([1, 7, 16, 3, 130], [1, 9, 16, 3, 200], True), ([0, 5, 64, 3], [2, 5, 64, 6], False)]
# bf16/fp16 kernels vs an fp32-accumulating reference on the same rounded inputs.
ATOL = {torch.bfloat16: 3e-2, torch.float16: 5e-3}


def _backend(name, dtype):
    try:
        return select_backend(name, device="cuda", dtype=dtype)
    except ValueError as exc:
        pytest.skip(str(exc))


def _compare(got, want, dtype, what):
    for g, w, n in zip(got, want, what):
        torch.testing.assert_close(g.float(), w.float(), atol=ATOL[dtype], rtol=ATOL[dtype], msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("case", DENSE, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", ["flash", "te", "sdpa"])
def test_dense_matches_reference_on_cuda(name, dtype, case):
    backend, ref = _backend(name, dtype), ReferenceBackend()
    b, sq, sk, hq, hkv, d, causal = case
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed())
    q, dout = (torch.randn(b, sq, hq, d, device="cuda", generator=gen, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(b, sk, hkv, d, device="cuda", generator=gen, dtype=dtype) for _ in range(2))
    out, lse = backend.forward(q, k, v, causal=causal)
    ref_out, ref_lse = ref.forward(q, k, v, causal=causal)
    torch.testing.assert_close(lse, ref_lse, atol=1e-2, rtol=0)
    grads = backend.backward(dout, q, k, v, out, lse, causal=causal)
    ref_grads = ref.backward(dout, q, k, v, ref_out, ref_lse, causal=causal)
    _compare((out, *grads), (ref_out, *ref_grads), dtype, ("out", "dq", "dk", "dv"))


@pytest.mark.parametrize("case", VARLEN, ids=str)
@pytest.mark.parametrize("name", ["flash", "te", "sdpa"])
def test_varlen_matches_reference_on_cuda(name, case):
    dtype = torch.bfloat16
    backend, ref = _backend(name, dtype), ReferenceBackend()
    q_lens, k_lens, causal = case
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed())
    q, dout = (torch.randn(sum(q_lens), 8, 64, device="cuda", generator=gen, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(sum(k_lens), 2, 64, device="cuda", generator=gen, dtype=dtype) for _ in range(2))
    args = (cu_seqlens(q_lens).cuda(), cu_seqlens(k_lens).cuda(), max(q_lens), max(k_lens))
    out, lse = backend.varlen_forward(q, k, v, *args, causal=causal)
    ref_out, ref_lse = ref.varlen_forward(q, k, v, *args, causal=causal)
    torch.testing.assert_close(lse, ref_lse, atol=1e-2, rtol=0)
    grads = backend.varlen_backward(dout, q, k, v, out, lse, *args, causal=causal)
    ref_grads = ref.varlen_backward(dout, q, k, v, ref_out, ref_lse, *args, causal=causal)
    _compare((out, *grads), (ref_out, *ref_grads), dtype, ("out", "dq", "dk", "dv"))


def test_sdpa_float32_on_cuda_uses_the_efficient_kernel_correctly():
    backend, ref = _backend("sdpa", torch.float32), ReferenceBackend()
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed())
    q, dout = (torch.randn(2, 45, 4, 40, device="cuda", generator=gen) for _ in range(2))
    k, v = (torch.randn(2, 70, 2, 40, device="cuda", generator=gen) for _ in range(2))
    out, lse = backend.forward(q, k, v, causal=True)
    ref_out, ref_lse = ref.forward(q, k, v, causal=True)
    grads = backend.backward(dout, q, k, v, out, lse, causal=True)
    ref_grads = ref.backward(dout, q, k, v, ref_out, ref_lse, causal=True)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=0)
    for g, w in zip((out, *grads), (ref_out, *ref_grads)):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-3)
