"""Packed windows in SlimPipe's data path: the slicing iterator records each microbatch's documents
(from ``document_lengths`` or Megatron's block-causal mask) where attention and RoPE read them."""

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
