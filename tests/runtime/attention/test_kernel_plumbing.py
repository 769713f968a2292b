"""CPU checks of the GPU-only adapters' plumbing (the kernels themselves are covered by gpu tests).

- torch's CUDA SDPA ops have meta kernels: running the adapters on the meta device checks
  argument order, layouts, head padding and GQA head reduction against the real op schemas.
- flash-attn's private functions change signature between releases: the keyword filter must
  send each release only the arguments it accepts, also through torch.library.custom_op.
"""

import pytest
import torch

from megatron_slim.runtime.attention import flash_api
from megatron_slim.runtime.attention.sdpa_kernels import CudaEfficientKernels, CudaFlashKernels


@pytest.mark.parametrize("kernels", [CudaFlashKernels, CudaEfficientKernels], ids=lambda k: k.__name__)
def test_cuda_sdpa_adapters_shapes_on_meta_device(kernels):
    q = torch.empty(2, 7, 4, 36, device="meta", dtype=torch.bfloat16)
    k = torch.empty(2, 13, 2, 36, device="meta", dtype=torch.bfloat16)
    out, lse = kernels().forward(q, k, k, True, 0.3)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (2, 4, 7) and lse.dtype == torch.float32
    dq, dk, dv = kernels().backward(q, q, k, k, out, lse, True, 0.3)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, k.shape)
    assert {dq.dtype, dk.dtype, dv.dtype} == {torch.bfloat16}


def _fa26_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_softmax):
    assert window_size == (-1, -1) and dropout_p == 0.0 and not return_softmax
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), softmax_scale)
    return q + 1, q, k, v, q + 1, lse, None, None  # flash-attn 2.6 returns 8 values


@torch.library.custom_op("mslim_test::fa27_forward", mutates_args=())
def _fa27_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, softmax_scale: float, causal: bool,
    window_size_left: int, window_size_right: int, softcap: float, alibi_slopes: torch.Tensor | None,
    return_softmax: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    assert (window_size_left, window_size_right) == (-1, -1)
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), softmax_scale)
    return q + 2, lse, q.new_empty(0), q.new_empty(2)  # flash-attn 2.7 returns 4 values


def _fa3_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                  max_seqlen_k=None, dq=None, dk=None, dv=None, softmax_scale=None, is_causal=False,
                  window_size_left=-1, window_size_right=-1, softcap=0.0, deterministic=False, sm_margin=0):
    assert is_causal and softmax_scale == 0.5
    dq.fill_(1.0), dk.fill_(2.0), dv.fill_(3.0)


@pytest.mark.parametrize("fwd, added", [(_fa26_forward, 1.0), (_fa27_forward, 2.0)], ids=["fa2.6", "fa2.7-custom-op"])
def test_flash_forward_adapts_to_each_release_signature(fwd, added):
    api = flash_api.FlashApi("fake", fwd, None, None, None)
    q = torch.zeros(2, 5, 3, 8)
    out, lse = api.forward(q, q, q, True, 0.25)
    assert torch.equal(out, q + added)
    assert lse.shape == (2, 3, 5) and bool((lse == 0.25).all())


def test_flash3_backward_gets_is_causal_and_fills_grads():
    api = flash_api.FlashApi("fake", None, _fa3_backward, None, None)
    q, k = torch.zeros(1, 4, 2, 8), torch.zeros(1, 6, 1, 8)
    dq, dk, dv = api.backward(q, q, k, k, q, torch.zeros(1, 2, 4), True, 0.5)
    assert bool((dq == 1).all()) and bool((dk == 2).all()) and bool((dv == 3).all())
    assert dk.shape == k.shape
