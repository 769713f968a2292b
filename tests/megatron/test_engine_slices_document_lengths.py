"""From megatron-core 0.19 ``pretrain_gpt.get_batch`` hands TP rank 0's whole slice dict to
``get_batch_on_this_cp_rank``, which cuts every non-metadata value along the sequence; the launcher's
wrapper must take the slice's ``document_lengths`` (a tuple) out before Megatron's split sees it."""

import torch

from megatron_slim.megatron.slimpipe.engine_slices import EngineSlices, without_document_lengths
from megatron_slim.runtime.pipeline.slice_context import SliceContext


def _slice() -> dict:
    tokens = torch.arange(8).view(1, 8)
    return {"tokens": tokens, "labels": tokens + 1, "document_lengths": (3, 5), "cu_seqlens": None}


def test_megatrons_split_sees_only_the_slice_tensors():
    seen = {}

    def megatron_split(batch, *args, **kwargs):  # cuts every non-None value like 0.19's per-sequence split
        seen.update(batch, args=args, kwargs=kwargs)
        return {k: v if v is None else v.view(1, 2, 4)[:, 0] for k, v in batch.items()}

    split = EngineSlices(SliceContext(), lambda: None, plan_inputs=None).wrap_batch_split(megatron_split)
    batch = _slice()
    out = split(batch, is_hybrid_cp=False, cp_group=None)
    assert set(out) == {"tokens", "labels", "cu_seqlens"} and out["tokens"].tolist() == [[0, 1, 2, 3]]
    assert seen["kwargs"] == {"is_hybrid_cp": False, "cp_group": None}
    assert batch["document_lengths"] == (3, 5)  # the caller's dict is left as it was


def test_batches_without_lengths_pass_unchanged():
    batch = {"tokens": torch.zeros(1, 4)}
    assert without_document_lengths(batch) is batch
    tensor = torch.zeros(1, 4)
    assert without_document_lengths(tensor) is tensor
