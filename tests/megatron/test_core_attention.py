"""SlimCoreAttention: megatron's constructor and forward contracts, and the ``attend`` seam.

Tolerance: fp32 attention against torch SDPA, 1e-5 absolute (same math, other summation order).
"""

import pytest
import torch
import torch.nn.functional as F
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnMaskType

from megatron_slim.megatron.model.core_attention import SlimCoreAttention
from tests.oracle.attention import naive_attention


def causal_attention(q, k, v, softmax_scale):
    """The float64 reference (query ``i`` of ``sq`` sees keys ``j <= i + sk - sq``), in q's dtype."""
    return naive_attention(q, k, v, True, softmax_scale)[0].to(q.dtype)


def config(**overrides):
    fields = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def qkv(b=2, sq=8, sk=8, hq=4, hkv=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(b, sq, hq, d, generator=g),
        torch.randn(b, sk, hkv, d, generator=g),
        torch.randn(b, sk, hkv, d, generator=g),
    )


@pytest.mark.parametrize("hq, hkv", [(4, 4), (4, 2), (4, 1), (6, 3)])
def test_causal_attention_matches_sdpa_with_gqa(hq, hkv):
    q, k, v = qkv(hq=hq, hkv=hkv)
    out = causal_attention(q, k, v, softmax_scale=0.25)
    expected = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=0.25, enable_gqa=True
    ).transpose(1, 2)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)


def test_query_head_i_reads_kv_head_i_div_group():
    q, k, v = qkv(hq=4, hkv=2)
    v = v.clone()
    v[:, :, 1] = 0.0  # kv head 1 serves query heads 2 and 3
    out = causal_attention(q, k, v, softmax_scale=0.25)
    assert out[:, :, 2:].abs().max() == 0 and out[:, :, :2].abs().min() > 0


def test_shorter_query_block_is_the_tail_of_the_sequence():
    """With a K/V prefix (sk > sq) the queries are the last sq positions: equal to the tail of
    full causal attention over sk queries."""
    q_full, k, v = qkv(sq=12, sk=12)
    full = causal_attention(q_full, k, v, softmax_scale=0.3)
    tail = causal_attention(q_full[:, 8:], k, v, softmax_scale=0.3)
    torch.testing.assert_close(tail, full[:, 8:], rtol=0, atol=1e-6)


def test_constructor_accepts_each_versions_keywords_and_unknown_ones():
    cfg = config()
    pgs = object()
    new = SlimCoreAttention(
        config=cfg,
        layer_number=3,
        attn_mask_type=AttnMaskType.causal,
        attention_type="self",
        cp_comm_type="p2p",
        softmax_scale=None,
        pg_collection=pgs,
    )
    old = SlimCoreAttention(
        config=cfg,
        layer_number=3,
        attn_mask_type=AttnMaskType.causal,
        attention_type="self",
        cp_comm_type=None,
        softmax_scale=0.5,
        model_comm_pgs=pgs,
        some_future_keyword=1,
    )
    assert new.pg_collection is pgs and old.pg_collection is pgs
    assert new.softmax_scale == pytest.approx(1 / 4) and old.softmax_scale == 0.5
    assert old.extra_kwargs == {"some_future_keyword": 1}
    assert new.layer_number == 3 and new.cp_comm_type == "p2p"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(attention_type="cross"), "attention_type"),
        (dict(attention_dropout=0.1), "attention_dropout"),
    ],
)
def test_constructor_rejects_what_it_cannot_honour(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SlimCoreAttention(config=config(), layer_number=1, attn_mask_type=AttnMaskType.causal, **kwargs)


def test_forward_uses_megatron_layout_and_the_attend_seam():
    calls = []

    class Recording(SlimCoreAttention):
        def attend(self, q, k, v):
            calls.append((q.shape, k.shape))
            return super().attend(q, k, v)

    attention = Recording(config=config(), layer_number=1, attn_mask_type=AttnMaskType.causal)
    q, k, v = qkv(b=2, sq=8, hq=4, hkv=2, d=16)
    sbhd = [t.transpose(0, 1).contiguous() for t in (q, k, v)]  # megatron's [s, b, heads, d]
    out = attention(*sbhd, attention_mask=None, attn_mask_type=AttnMaskType.causal)
    assert out.shape == (8, 2, 4 * 16)
    assert calls == [((2, 8, 4, 16), (2, 8, 2, 16))]
    expected = causal_attention(q, k, v, attention.softmax_scale)
    # the default seam runs the kernel library (fp32 kernels: round-off only)
    torch.testing.assert_close(out, expected.transpose(0, 1).reshape(8, 2, -1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(attn_mask_type=AttnMaskType.padding), "attn_mask_type"),
        (dict(attention_bias=torch.zeros(1)), "attention_bias"),
        (dict(packed_seq_params=object()), "packed_seq_params.qkv_format"),
    ],
)
def test_forward_rejects_unsupported_inputs(kwargs, match):
    attention = SlimCoreAttention(config=config(), layer_number=1, attn_mask_type=AttnMaskType.causal)
    q, k, v = (t.transpose(0, 1) for t in qkv())
    with pytest.raises(ValueError, match=match):
        attention(q, k, v, None, **kwargs)
