"""SlimCoreAttention with megatron-core's THD ``PackedSeqParams``: output and input gradients against
plain causal attention run on each document alone (float64 reference), with and without padded
offsets, with grouped-query attention; and the refusals of what is not supported.

Tolerance: fp32 kernels against the float64 reference, 1e-5 absolute.
"""

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType

from megatron_slim.megatron.model.core_attention import SlimCoreAttention
from megatron_slim.megatron.model.packed_seq import thd_documents
from tests.megatron.test_core_attention import config
from tests.oracle.attention import naive_attention

ATOL = 1e-5


def offsets(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


def thd_params(real, padded=None):
    cu, cu_padded = offsets(real), offsets(padded) if padded is not None else None
    longest = max(padded or real)
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu.clone(),
        cu_seqlens_q_padded=cu_padded,
        cu_seqlens_kv_padded=cu_padded.clone() if cu_padded is not None else None,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )


def packed_qkv(total, hq, hkv, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(total, hq, d), (total, hkv, d), (total, hkv, d)]
    return [torch.randn(*s, generator=g).requires_grad_() for s in shapes]


def per_document_reference(q, k, v, dout, real, padded, scale):
    """Each document's real tokens alone through float64 causal attention; padding rows get zero
    output and zero gradients."""
    out, grads = torch.zeros_like(q, dtype=torch.float64), [torch.zeros_like(t, dtype=torch.float64) for t in (q, k, v)]
    start = 0
    for n, slot in zip(real, padded):
        rows = slice(start, start + n)
        doc = [t.detach()[rows].double().unsqueeze(0).requires_grad_() for t in (q, k, v)]
        o = naive_attention(*doc, True, scale)[0]
        o.backward(dout[rows].double().unsqueeze(0))
        out[rows] = o.detach()[0]
        for g, t in zip(grads, doc):
            g[rows] = t.grad[0]
        start += slot
    return out, grads


@pytest.mark.parametrize("hq, hkv", [(4, 2), (4, 1), (6, 3)])
@pytest.mark.parametrize(
    "real, padded",
    [((5, 1, 9, 3), None), ((5, 1, 9, 3), (8, 4, 12, 4)), ((7, 0, 4), (8, 4, 4))],
    ids=["unpadded", "padded", "padded-empty-sequence"],
)
@pytest.mark.parametrize("mask", [AttnMaskType.causal, AttnMaskType.padding_causal])
def test_thd_pack_matches_per_document_attention(hq, hkv, real, padded, mask):
    d = 16
    attention = SlimCoreAttention(
        config=config(num_attention_heads=hq, num_query_groups=hkv, hidden_size=hq * d),
        layer_number=1,
        attn_mask_type=mask,
    )
    slots = padded or real
    q, k, v = packed_qkv(sum(slots), hq, hkv, d)
    out = attention(q, k, v, None, attn_mask_type=mask, packed_seq_params=thd_params(real, padded))
    assert out.shape == (sum(slots), hq * d)  # megatron reshapes it to [t, 1, hq * d]
    dout = torch.randn(sum(slots), hq, d, generator=torch.Generator().manual_seed(1))
    out.backward(dout.reshape(out.shape))

    expected, expected_grads = per_document_reference(q, k, v, dout, real, slots, attention.softmax_scale)
    torch.testing.assert_close(out.detach().double(), expected.reshape(out.shape), rtol=0, atol=ATOL)
    for name, t, g in zip("qkv", (q, k, v), expected_grads):
        torch.testing.assert_close(t.grad.double(), g, rtol=0, atol=ATOL, msg=f"d{name}")


def test_documents_do_not_see_each_other():
    """Power check: the pack's second document differs from attention over the unsplit window."""
    attention = SlimCoreAttention(config=config(), layer_number=1, attn_mask_type=AttnMaskType.causal)
    q, k, v = packed_qkv(10, 4, 2)
    packed = attention(q, k, v, None, packed_seq_params=thd_params((4, 6)))
    whole = attention(*(t.unsqueeze(1) for t in (q, k, v)), None).reshape(10, -1)
    torch.testing.assert_close(packed[:4], whole[:4], rtol=0, atol=ATOL)
    assert (packed[4:] - whole[4:]).abs().max() > 1e-2


def test_thd_documents_reads_padded_slots():
    docs = thd_documents(thd_params((3, 0, 2), (4, 2, 2)), 8)
    assert docs.lengths == (4, 2, 2) and docs.real == (3, 0, 2) and docs.padded
    assert docs.real_rows(torch.device("cpu")).tolist() == [1, 1, 1, 0, 0, 0, 1, 1]
    assert thd_documents(thd_params((3, 5)), 8).lengths == (3, 5)


class FakeGroup:
    def __init__(self, size):
        self._size = size

    def size(self):
        return self._size


def _with(params, **fields):
    for name, value in fields.items():
        setattr(params, name, value)
    return params


@pytest.mark.parametrize(
    "params, match",
    [
        (_with(thd_params((4, 4)), qkv_format="sbhd"), "qkv_format='sbhd'"),
        (_with(thd_params((4, 4)), cu_seqlens_kv=offsets((2, 6))), "cu_seqlens_kv"),
        (_with(thd_params((4, 4), (4, 4)), cu_seqlens_kv_padded=None), "cu_seqlens_kv_padded"),
        (_with(thd_params((5, 3), (4, 4))), "padded lengths >= real lengths"),
        (thd_params((4, 3)), "ending at the token count"),
        (_with(thd_params((4, 4)), cu_seqlens_q=None, cu_seqlens_kv=None), "cu_seqlens_q=None"),
        (_with(thd_params((4, 4)), local_cp_size=2), "local_cp_size 2"),
        (_with(thd_params((4, 4)), cp_group=FakeGroup(2)), "cp_group size 2"),
    ],
    ids=[
        "format",
        "kv-differs",
        "padded-kv-missing",
        "padded-too-short",
        "token-count",
        "no-offsets",
        "local-cp",
        "cp-group",
    ],
)
def test_refuses_what_it_does_not_support(params, match):
    attention = SlimCoreAttention(config=config(), layer_number=1, attn_mask_type=AttnMaskType.causal)
    q, k, v = packed_qkv(8, 4, 2)
    with pytest.raises(ValueError, match=match):
        attention(q, k, v, None, packed_seq_params=params)


def test_refuses_thd_under_context_parallelism_and_batched_layout():
    cp = SlimCoreAttention(config=config(), layer_number=1, pg_collection=type("P", (), {"cp": FakeGroup(2)})())
    q, k, v = packed_qkv(8, 4, 2)
    with pytest.raises(ValueError, match="context parallel size 2"):
        cp(q, k, v, None, packed_seq_params=thd_params((4, 4)))
    plain = SlimCoreAttention(config=config(), layer_number=1)
    with pytest.raises(ValueError, match=r"\[tokens, heads, head_dim\]"):
        plain(*(t.unsqueeze(1) for t in (q, k, v)), None, packed_seq_params=thd_params((4, 4)))
    with pytest.raises(ValueError, match="attn_mask_type"):
        plain(*(t.unsqueeze(1) for t in (q, k, v)), None, attn_mask_type=AttnMaskType.padding_causal)


@pytest.fixture(scope="module")
def thd_model_result():
    from megatron_slim.runtime.spawn import run_ranks
    from tests.megatron import _thd_workers

    return run_ranks(_thd_workers.thd_model, 1, 11)[0]


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_megatron_gpt_model_with_thd_pack_equals_documents_one_by_one(thd_model_result, padded):
    """Through megatron-core's own GPTModel, SelfAttention (batch squeeze) and THD RoPE: the pack's
    real-token losses and every gradient equal running each document alone."""
    run = thd_model_result[padded]
    (losses, grads), (ref_losses, ref_grads) = run["packed"], run["reference"]
    torch.testing.assert_close(losses, ref_losses, rtol=0, atol=1e-5)
    assert set(grads) == set(ref_grads)
    for name, grad in grads.items():
        err = ((grad - ref_grads[name]).norm() / ref_grads[name].norm().clamp_min(1e-30)).item()
        assert err < 1e-5, name
    assert (run["whole"] - ref_losses).abs().max() > 1e-3  # without the pack's documents it differs


def test_slice_and_cp_attentions_take_thd_outside_a_schedule_and_refuse_it_inside():
    from types import SimpleNamespace

    from megatron_slim.megatron.cp.attention import CPCoreAttention
    from megatron_slim.megatron.slimpipe.slicing import SliceCoreAttention
    from megatron_slim.runtime.pipeline.slice_context import SliceContext, SliceInfo

    q, k, v = packed_qkv(8, 4, 2)
    params = thd_params((3, 5))
    plain = SlimCoreAttention(config=config(), layer_number=1)(q, k, v, None, packed_seq_params=params)
    sliced = SliceCoreAttention(config=config(), layer_number=1)
    sliced.context = SliceContext()
    torch.testing.assert_close(sliced(q, k, v, None, packed_seq_params=params), plain, rtol=0, atol=0)
    inside = SliceInfo(microbatch=0, slice=0, num_slices=2, start=0, length=8)
    with sliced.context.enter(inside), pytest.raises(ValueError, match="document_lengths"):
        sliced(q, k, v, None, packed_seq_params=params)
    cp = CPCoreAttention(config=config(), layer_number=1)
    torch.testing.assert_close(cp(q, k, v, None, packed_seq_params=params), plain, rtol=0, atol=0)
    cp.context = SimpleNamespace(plan=object())
    with pytest.raises(ValueError, match="context-parallel plan"):
        cp(q, k, v, None, packed_seq_params=params)


def test_slice_documents_under_tensor_parallelism_need_every_tp_rank_reading_its_batch():
    """Megatron's TP batch broadcast leaves TP ranks > 0 without the documents: refused unless the
    caller (``megatron-slim train``) says every TP rank reads its own batch."""
    from megatron_slim.megatron.slimpipe.slicing import SliceCoreAttention
    from megatron_slim.runtime.pipeline.slice_context import SliceContext, SliceInfo

    info = SliceInfo(microbatch=0, slice=0, num_slices=2, start=0, length=4)
    q = torch.zeros(1, 4, 4, 16)
    tp2 = type("P", (), {"tp": FakeGroup(2), "cp": None})()
    for every_rank in (False, True):
        attention = SliceCoreAttention(config=config(), layer_number=1, pg_collection=tp2)
        attention.context = SliceContext(documents_on_every_tp_rank=every_rank)
        attention.context.documents.record(0, (3, 5))
        if every_rank:
            assert attention._documents(info, q) == (3, 5)
        else:
            with pytest.raises(ValueError, match="documents_on_every_tp_rank=True"):
                attention._documents(info, q)
