"""Packed windows in SlimPipe's data path: the slicing iterator records each microbatch's documents
(from ``document_lengths``, Megatron's block-causal mask or its THD offsets ``cu_seqlens``) where
attention and RoPE read them."""

import pytest
import torch

from megatron_slim.megatron.model.rotary import make_cpu_rotary_embedding
from megatron_slim.megatron.slimpipe.slicing import SliceRotary
from megatron_slim.runtime.pipeline.slice_context import SliceContext, SliceInfo
from megatron_slim.runtime.pipeline.sliced_data import SlicedIterator
from tests.runtime.pipeline._packed_workers import block_causal_mask

DOCS = (3, 9, 4)


def _batch(**extra):
    return {"tokens": torch.arange(16).view(1, 16), "loss_mask": torch.ones(1, 16), **extra}


def _read(batches, context, microbatch=0, slices=(8, 8)):
    it = SlicedIterator(iter(batches), slices, context)
    parts = []
    for j in range(len(slices)):
        with context.enter(SliceInfo(microbatch, j, len(slices), 8 * j, slices[j])):
            parts.append(next(it))
    return parts


@pytest.mark.parametrize("extra", [{"document_lengths": DOCS}, {"attention_mask": block_causal_mask(DOCS)}])
def test_documents_are_recorded_for_the_current_microbatch(extra):
    context = SliceContext()
    parts = _read([_batch(**extra)], context, microbatch=3)
    assert context.documents.lookup(3) == DOCS and context.documents.lookup(0) is None
    if "document_lengths" in extra:
        assert all(p["document_lengths"] == DOCS for p in parts)
    else:
        assert torch.equal(parts[1]["attention_mask"], extra["attention_mask"][..., 8:16, 8:16])


def _offsets(*values):
    return torch.tensor([values], dtype=torch.int32)  # [1, k]: what the loader's collate gives (b = 1)


def test_thd_offsets_are_the_documents_and_no_slice_carries_them():
    """An ``--sft`` batch: ``cu_seqlens [1, k]`` and ``max_seqlen``; the slices hand the forward step
    no offsets, so ``pretrain_gpt.get_batch`` builds no window-wide ``PackedSeqParams`` for a slice."""
    context = SliceContext()
    batch = _batch(cu_seqlens=_offsets(0, 3, 12, 16), max_seqlen=torch.tensor([9], dtype=torch.int32))
    parts = _read([batch], context, microbatch=2)
    assert context.documents.lookup(2) == DOCS
    assert all(set(p) == {"tokens", "loss_mask"} for p in parts)
    assert torch.equal(parts[1]["tokens"], torch.arange(8, 16).view(1, 8))


def test_thd_padded_slots_are_documents():
    """Each padded slot (``cu_seqlens_padded``) is one document: its padding follows its real tokens."""
    context = SliceContext()
    batch = _batch(cu_seqlens=_offsets(0, 2, 10, 13), cu_seqlens_padded=_offsets(0, 3, 12, 16))
    _read([batch], context)
    assert context.documents.lookup(0) == DOCS


@pytest.mark.parametrize(
    "extra,match",
    [
        ({"cu_seqlens": _offsets(0, 3, 12, 15)}, "end at 15"),
        ({"cu_seqlens": _offsets(0, 5, 3, 16)}, "non-decreasing"),
        ({"cu_seqlens": torch.tensor([[0, 16], [0, 16]], dtype=torch.int32)}, "micro-batch size 1"),
        ({"cu_seqlens": _offsets(0, 4, 16), "cu_seqlens_padded": _offsets(0, 3, 16)}, "at least as long"),
        ({"cu_seqlens": _offsets(0, 4, 16), "document_lengths": DOCS}, "disagree"),
    ],
)
def test_bad_thd_offsets_are_refused(extra, match):
    with pytest.raises(ValueError, match=match):
        _read([_batch(**extra)], SliceContext())


def test_plain_windows_record_nothing():
    context = SliceContext()
    causal = torch.ones(16, 16, dtype=torch.bool).triu(1).view(1, 1, 16, 16)
    _read([_batch(attention_mask=causal)], context)
    assert context.documents.lookup(0) is None


def test_other_masks_are_refused_naming_the_alternative():
    mask = block_causal_mask(DOCS).clone()
    mask[0, 0, 15, 0] = False
    with pytest.raises(ValueError, match="document_lengths"):
        _read([_batch(attention_mask=mask)], SliceContext())


@pytest.mark.parametrize(
    "batch,match",
    [
        ({"tokens": torch.zeros(2, 16), "document_lengths": DOCS}, "micro-batch size 1"),
        (_batch(document_lengths=(3, 9)), "sum to 12 tokens"),
        (_batch(document_lengths=DOCS, attention_mask=block_causal_mask((4, 12))), "disagree"),
    ],
)
def test_bad_packs_are_refused(batch, match):
    with pytest.raises(ValueError, match=match):
        _read([batch], SliceContext())


def test_a_pack_read_outside_a_slice_is_refused():
    with pytest.raises(ValueError, match="outside a SlimPipe slice"):
        next(SlicedIterator(iter([_batch(document_lengths=DOCS)]), (8, 8), SliceContext()))


def test_rotary_positions_restart_in_each_document():
    rotary = make_cpu_rotary_embedding(
        kv_channels=16, rotary_percent=1.0, rotary_base=10000.0, use_cpu_initialization=True
    )
    whole = rotary(16)  # positions 0 .. 15
    context = SliceContext()
    context.documents.record(0, DOCS)
    sliced = SliceRotary(rotary, context)
    with context.enter(SliceInfo(0, 1, 2, 8, 8)):
        table = sliced(8, packed_seq=False, cp_group=None)
    assert torch.equal(table, whole[[5, 6, 7, 8, 0, 1, 2, 3]])  # documents 3..11 and 12..15
