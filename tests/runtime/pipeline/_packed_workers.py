"""Rank functions for packed windows under SlimPipe (module level so spawn can import them)."""

import dataclasses

import torch

from megatron_slim.plan.recipe import ModelConfig
from megatron_slim.train.microbatch import forward_step  # the training job's own
from tests.oracle import reference
from tests.oracle.models import TINY_GQA_8L


def block_causal_mask(lengths) -> torch.Tensor:
    """Megatron's ``--reset-attention-mask`` mask ``[1, 1, s, s]`` (True = masked), entry by entry."""
    s = sum(lengths)
    doc = [d for d, n in enumerate(lengths) for _ in range(n)]
    visible = torch.tensor([[j <= i and doc[j] == doc[i] for j in range(s)] for i in range(s)])
    return (~visible).view(1, 1, s, s)


def make_packed_batches(model: ModelConfig, windows, seed: int, as_mask: bool = False):
    """One ``b = 1`` batch per window of document lengths; the last document is padding (loss 0).
    ``as_mask``: the documents as Megatron's block-causal mask instead of ``document_lengths``."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for lengths in windows:
        tokens = torch.randint(0, model.vocab_size, (1, model.seq_length + 1), generator=g)
        mask = (torch.rand(1, model.seq_length, generator=g) > 0.15).float()
        mask[:, model.seq_length - lengths[-1] :] = 0.0
        pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
        batch = {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(), "loss_mask": mask}
        batch["position_ids"] = pos
        if as_mask:
            batch["attention_mask"] = block_causal_mask(lengths)
        else:
            batch["document_lengths"] = tuple(lengths)
        batches.append(batch)
    return batches


def _packs(batches, windows):
    return [
        {"tokens": b["tokens"][0], "labels": b["labels"][0], "loss_mask": b["loss_mask"][0], "lengths": w}
        for b, w in zip(batches, windows)
    ]


def run_packed(rank, world_size, configs, seed=1234):
    """Each config: (vpp, slice_lengths, windows, backend, as_mask). Returns per config
    (token-weighted loss from the reports, grads, reference (loss, grads) on rank 0)."""
    from megatron_slim.megatron.model.gpt import build_rank_chunks, global_grads
    from megatron_slim.megatron.model.parallel import init_model_parallel
    from megatron_slim.megatron.slimpipe.schedule import SlimPipeSettings, make_forward_backward_func
    from megatron_slim.megatron.slimpipe.slicing import SliceCoreAttention

    groups = init_model_parallel(pp=world_size)
    model = ModelConfig(**TINY_GQA_8L)
    results = []
    for vpp, lengths, windows, backend, as_mask in configs:
        batches = make_packed_batches(model, windows, seed, as_mask)
        chunks = build_rank_chunks(
            model, dataclasses.replace(groups, vpp=vpp), core_attention=SliceCoreAttention, seed=seed
        )
        fb = make_forward_backward_func(SlimPipeSettings(tuple(lengths), attention_backend=backend))
        reports = fb(
            forward_step_func=forward_step,
            data_iterator=[iter(batches) for _ in chunks],
            model=chunks,
            num_microbatches=len(batches),
            seq_length=model.seq_length,
            micro_batch_size=1,
        )
        backends = {
            m.attention_backend(torch.zeros(1)).name
            for c in chunks
            for m in c.modules()
            if isinstance(m, SliceCoreAttention)
        }
        loss = None
        if reports:
            total = torch.stack([r["lm loss"] for r in reports]).sum(0)
            loss = total[0] / total[1]
        grads = {}
        for c in chunks:
            grads.update(global_grads(c))
        ref = reference.per_document_step(model, groups, _packs(batches, windows), seed) if rank == 0 else None
        results.append((loss, grads, ref, backends))
    return results
