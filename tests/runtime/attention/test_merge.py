"""Log-sum-exp merge of partials over disjoint key sets."""

import pytest
import torch

from megatron_slim.runtime.attention import ReferenceBackend, SdpaBackend, merge, merge_
from tests.oracle.attention import assert_close, fresh_seed

BACKENDS = {"reference": ReferenceBackend(), "sdpa": SdpaBackend()}


def _qkv(seed, b=2, sq=7, sk=19, hq=4, hkv=2, d=8, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(b, sq, hq, d, generator=gen).to(dtype),
        torch.randn(b, sk, hkv, d, generator=gen).to(dtype),
        torch.randn(b, sk, hkv, d, generator=gen).to(dtype),
    )


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_full_attention_over_concatenated_keys_is_the_merge_of_the_parts(name):
    seed = fresh_seed()
    q, k, v = _qkv(seed)
    backend = BACKENDS[name]
    whole = backend.forward(q, k, v, causal=False)
    cut = 1 + seed % (k.shape[1] - 1)
    part_a = backend.forward(q, k[:, :cut], v[:, :cut], causal=False)
    part_b = backend.forward(q, k[:, cut:], v[:, cut:], causal=False)
    out, lse = merge(*part_a, *part_b)
    # float64 inputs, but lse is float32 by contract: the merge weights carry ~1e-7 relative error.
    assert_close(out, whole[0], 1e-6, 1e-6, f"{name} merged out (cut {cut})", seed)
    assert_close(lse, whole[1], 1e-6, 0, f"{name} merged lse (cut {cut})", seed)


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_causal_prefix_plus_diagonal_block_is_bottom_right_causal(name):
    seed = fresh_seed()
    q, k, v = _qkv(seed, sq=6, sk=17)
    backend = BACKENDS[name]
    prefix = k.shape[1] - q.shape[1]
    whole = backend.forward(q, k, v, causal=True)
    full_part = backend.forward(q, k[:, :prefix], v[:, :prefix], causal=False)
    diag_part = backend.forward(q, k[:, prefix:], v[:, prefix:], causal=True)
    out, lse = merge(*full_part, *diag_part)
    assert_close(out, whole[0], 1e-6, 1e-6, f"{name} merged out", seed)
    assert_close(lse, whole[1], 1e-6, 0, f"{name} merged lse", seed)


def test_fully_masked_partial_contributes_nothing_even_if_its_out_is_nan():
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    out_a, lse_a = torch.randn(2, 5, 3, 4, generator=gen), torch.randn(2, 3, 5, generator=gen)
    out_b = torch.full_like(out_a, float("nan"))
    lse_b = torch.full_like(lse_a, float("-inf"))
    out, lse = merge(out_a, lse_a, out_b, lse_b)
    assert torch.equal(out, out_a) and torch.equal(lse, lse_a)
    out, lse = merge(out_b, lse_b, out_a, lse_a)
    assert torch.equal(out, out_a) and torch.equal(lse, lse_a)
    # rows nobody saw: out 0, lse -inf, no NaN
    out, lse = merge(out_b, lse_b, out_b.clone(), lse_b.clone())
    assert torch.equal(out, torch.zeros_like(out)) and bool(torch.isneginf(lse).all())


def test_in_place_accumulate_over_many_chunks_equals_whole_attention_varlen_layout():
    """Also exercises the varlen layout: out [t, h, d], lse [h, t]."""
    seed = fresh_seed()
    q, k, v = _qkv(seed, b=1, sq=9, sk=23)
    backend = ReferenceBackend()
    out_whole, lse_whole = backend.forward(q, k, v, causal=False)
    out_acc = torch.zeros(9, 4, 8, dtype=torch.float64)
    lse_acc = torch.full((4, 9), float("-inf"), dtype=torch.float32)
    for start in range(0, 23, 5):
        o, o_lse = backend.forward(q, k[:, start : start + 5], v[:, start : start + 5], causal=False)
        returned = merge_(out_acc, lse_acc, o[0], o_lse[0])
        assert returned[0] is out_acc and returned[1] is lse_acc
    assert_close(out_acc, out_whole[0], 1e-6, 1e-6, "accumulated out", seed)
    assert_close(lse_acc, lse_whole[0], 1e-5, 0, "accumulated lse", seed)


def test_merge_rejects_mismatched_shapes():
    out, lse = torch.zeros(1, 5, 3, 4), torch.zeros(1, 3, 5)
    with pytest.raises(ValueError, match="must have equal shapes"):
        merge(out, lse, torch.zeros(1, 6, 3, 4), lse)
    with pytest.raises(ValueError, match="does not match out"):
        merge(out, torch.zeros(1, 5, 3), out, torch.zeros(1, 5, 3))
