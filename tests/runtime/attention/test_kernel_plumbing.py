"""CPU checks of the GPU-only adapters' plumbing (the kernels themselves are covered by gpu tests).

- torch's CUDA SDPA ops have meta kernels: running the adapters on the meta device checks
  argument order, layouts, head padding and GQA head reduction against the real op schemas.
- flash-attn's private functions change signature between releases: the keyword filter must
  send each release only the arguments it accepts, also through torch.library.custom_op.
"""

import pytest
import torch

from megatron_slim.runtime.attention import FlashBackend, ReferenceBackend, flash_api
from megatron_slim.runtime.attention import flash as flash_backend_module
from megatron_slim.runtime.attention.sdpa_kernels import CudaEfficientKernels, CudaFlashKernels
from tests.oracle.attention import assert_close, fresh_seed


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
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    return_softmax: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    assert (window_size_left, window_size_right) == (-1, -1)
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), softmax_scale)
    return q + 2, lse, q.new_empty(0), q.new_empty(2)  # flash-attn 2.7 returns 4 values


def _fa3_backward(
    dout,
    q,
    k,
    v,
    out,
    softmax_lse,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    dq=None,
    dk=None,
    dv=None,
    softmax_scale=None,
    is_causal=False,
    window_size_left=-1,
    window_size_right=-1,
    softcap=0.0,
    deterministic=False,
    sm_margin=0,
):
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


class _FlashLikeApi:
    """Reference math with flash-attn's conventions: head_dim % 8 == 0, lse = +inf for keyless rows."""

    def __init__(self):
        self.ref = ReferenceBackend()

    def forward(self, q, k, v, causal, scale):
        assert q.shape[-1] % 8 == 0 and v.shape[-1] % 8 == 0
        out, lse = self.ref.forward(q, k, v, causal=causal, softmax_scale=scale)
        return out, torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        assert q.shape[-1] % 8 == 0 and not bool(torch.isneginf(lse).any())
        lse = torch.where(torch.isposinf(lse), torch.full_like(lse, float("-inf")), lse)
        return self.ref.backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=scale)


class _CpuFlashBackend(FlashBackend):
    def _check_inputs(self, q):  # the real one insists on CUDA
        pass


def test_flash_backend_pads_head_dim_and_converts_lse_convention():
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(2, 5, 4, 12, generator=gen) for _ in range(2))
    k, v = (torch.randn(2, 9, 2, 12, generator=gen) for _ in range(2))
    backend, ref = _CpuFlashBackend(_FlashLikeApi()), ReferenceBackend()
    out, lse = backend.forward(q, k, v, causal=True)
    ref_out, ref_lse = ref.forward(q, k, v, causal=True)
    assert out.shape == q.shape
    assert_close(out, ref_out, 1e-6, 1e-6, "out", seed)
    assert_close(lse, ref_lse, 1e-6, 0, "lse", seed)
    grads = backend.backward(dout, q, k, v, out, lse, causal=True)
    ref_grads = ref.backward(dout, q, k, v, ref_out, ref_lse, causal=True)
    for got, want, what in zip(grads, ref_grads, ("dq", "dk", "dv")):
        assert got.shape == want.shape
        assert_close(got, want, 1e-6, 1e-6, what, seed)


def test_flash_lse_convention_round_trip():
    """flash-attn marks a keyless row with lse = +inf, we with -inf; both directions convert."""
    theirs = torch.tensor([float("inf"), 1.5, -2.0])
    ours = flash_backend_module._lse_to_ours(theirs)
    assert ours.tolist() == [float("-inf"), 1.5, -2.0]
    assert flash_backend_module._lse_to_flash(ours).tolist() == theirs.tolist()


_UNSET = object()


def _recording(seen: dict):
    """A flash-attn function that accepts every keyword any release knows and records those it gets."""

    def fn(
        q=_UNSET, k=_UNSET, v=_UNSET, dout=_UNSET, out=_UNSET, softmax_lse=_UNSET, dq=_UNSET, dk=_UNSET,
        dv=_UNSET, cu_seqlens_q=_UNSET, cu_seqlens_k=_UNSET, max_seqlen_q=_UNSET, max_seqlen_k=_UNSET,
        dropout_p=_UNSET, softmax_scale=_UNSET, causal=_UNSET, is_causal=_UNSET, window_size=_UNSET,
        window_size_left=_UNSET, window_size_right=_UNSET, softcap=_UNSET, alibi_slopes=_UNSET,
        deterministic=_UNSET, rng_state=_UNSET, return_softmax=_UNSET, block_table=_UNSET,
    ):  # fmt: skip
        given = {name: value for name, value in locals().items() if value is not _UNSET and name != "seen"}
        seen.update({name: value for name, value in given.items() if not isinstance(value, torch.Tensor)})
        return q, torch.zeros(q.shape[1], q.shape[0])

    return fn


def test_flash_varlen_calls_send_exactly_the_fixed_arguments():
    """No dropout, softcap, ALiBi or window; no softmax returned, no RNG state, non-deterministic."""
    q, k = torch.zeros(6, 2, 8), torch.zeros(9, 1, 8)
    cu_q, cu_k = torch.tensor([0, 6], dtype=torch.int32), torch.tensor([0, 9], dtype=torch.int32)
    fwd_seen, bwd_seen = {}, {}
    api = flash_api.FlashApi("fake", None, None, _recording(fwd_seen), _recording(bwd_seen))
    api.varlen_forward(q, k, k, cu_q, cu_k, 6, 9, True, 0.5)
    api.varlen_backward(q, q, k, k, q, torch.zeros(2, 6), cu_q, cu_k, 6, 9, False, 0.5)
    fixed = {
        "max_seqlen_q": 6,
        "max_seqlen_k": 9,
        "dropout_p": 0.0,
        "softmax_scale": 0.5,
        "window_size": (-1, -1),
        "window_size_left": -1,
        "window_size_right": -1,
        "softcap": 0.0,
        "alibi_slopes": None,
    }
    assert fwd_seen == {**fixed, "causal": True, "return_softmax": False, "block_table": None}
    assert bwd_seen == {**fixed, "causal": False, "is_causal": False, "deterministic": False, "rng_state": None}
