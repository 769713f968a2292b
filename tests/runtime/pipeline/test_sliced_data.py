"""The slices SlimPipe's data iterator hands to a forward step."""

import torch

from megatron_slim.runtime.pipeline.sliced_data import SlicedIterator


def test_slices_of_a_batch_of_several_rows_are_contiguous_so_a_loss_may_view_them_flat():
    """Megatron-Bridge's masked_next_token_loss calls ``loss_mask.view(-1)`` (losses.py), which
    fails on a column slice of a [b > 1, s] tensor unless the slice is made contiguous."""
    batch = {"tokens": torch.arange(16).view(2, 8), "loss_mask": torch.ones(2, 8), "attention_mask": None}
    slices = list(SlicedIterator(iter([batch]), [3, 5]))
    for part, start, length in zip(slices, (0, 3), (3, 5)):
        for name in ("tokens", "loss_mask"):
            assert part[name].is_contiguous(), name
            assert torch.equal(part[name].view(-1), batch[name][:, start : start + length].reshape(-1))
        assert part["attention_mask"] is None
    tensor_slices = list(SlicedIterator(iter([batch["tokens"]]), [4, 4]))
    assert all(t.is_contiguous() for t in tensor_slices)
