"""Rank functions for packed windows under SlimPipe (module level so spawn can import them)."""

import dataclasses
import functools

import torch

from megatron_slim.plan.recipe import ModelConfig
from megatron_slim.train.microbatch import forward_step, loss_func  # the training job's own
from tests.oracle import reference
from tests.oracle.models import TINY_GQA_8L


def block_causal_mask(lengths) -> torch.Tensor:
    """Megatron's ``--reset-attention-mask`` mask ``[1, 1, s, s]`` (True = masked), entry by entry."""
    s = sum(lengths)
    doc = [d for d, n in enumerate(lengths) for _ in range(n)]
    visible = torch.tensor([[j <= i and doc[j] == doc[i] for j in range(s)] for i in range(s)])
    return (~visible).view(1, 1, s, s)


def make_packed_batches(model: ModelConfig, windows, seed: int, form: str = "key"):
    """One ``b = 1`` batch per window of document lengths; the last document is padding (loss 0).
    ``form``: the documents as the key ``document_lengths`` ("key"), Megatron's block-causal mask
    ("mask") or Megatron's THD offsets ``cu_seqlens [1, k]`` and ``max_seqlen`` ("thd", as ``--sft``)."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for lengths in windows:
        tokens = torch.randint(0, model.vocab_size, (1, model.seq_length + 1), generator=g)
        mask = (torch.rand(1, model.seq_length, generator=g) > 0.15).float()
        mask[:, model.seq_length - lengths[-1] :] = 0.0
        pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
        batch = {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(), "loss_mask": mask}
        batch["position_ids"] = pos
        if form == "mask":
            batch["attention_mask"] = block_causal_mask(lengths)
        elif form == "thd":
            offsets = [0, *torch.tensor(lengths).cumsum(0).tolist()]
            batch["cu_seqlens"] = torch.tensor([offsets], dtype=torch.int32)
            batch["max_seqlen"] = torch.tensor([max(lengths)], dtype=torch.int32)
        else:
            batch["document_lengths"] = tuple(lengths)
        batches.append(batch)
    return batches


def _packs(batches, windows):
    return [
        {"tokens": b["tokens"][0], "labels": b["labels"][0], "loss_mask": b["loss_mask"][0], "lengths": w}
        for b, w in zip(batches, windows)
    ]


def thd_forward_step(data_iterator, model):
    """``pretrain_gpt``'s forward step on a THD batch (``get_batch``'s branch for ``cu_seqlens``):
    ``PackedSeqParams`` from the batch's offsets when it has them, handed to the model."""
    from megatron.core.utils import get_thd_batch_on_this_cp_rank

    batch = dict(next(data_iterator))
    cu_seqlens, max_seqlen = batch.pop("cu_seqlens", None), batch.pop("max_seqlen", None)
    params = None
    if cu_seqlens is not None:
        batch, params = get_thd_batch_on_this_cp_rank(batch, cu_seqlens[0], None, max_seqlen, cp_size=1, cp_rank=0)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"], packed_seq_params=params)
    return output, functools.partial(loss_func, batch["loss_mask"])


def run_packed(rank, world_size, configs, seed=1234):
    """Each config: (vpp, slice_lengths, windows, backend, form of ``make_packed_batches``; "thd" runs
    ``thd_forward_step``). Returns per config
    (token-weighted loss from the reports, grads, reference (loss, grads) on rank 0)."""
    from megatron_slim.megatron.model.gpt import build_rank_chunks, global_grads
    from megatron_slim.megatron.model.parallel import init_model_parallel
    from megatron_slim.megatron.slimpipe.schedule import SlimPipeSettings, make_forward_backward_func
    from megatron_slim.megatron.slimpipe.slicing import SliceCoreAttention

    groups = init_model_parallel(pp=world_size)
    model = ModelConfig(**TINY_GQA_8L)
    results = []
    for vpp, lengths, windows, backend, form in configs:
        batches = make_packed_batches(model, windows, seed, form)
        chunks = build_rank_chunks(
            model, dataclasses.replace(groups, vpp=vpp), core_attention=SliceCoreAttention, seed=seed
        )
        fb = make_forward_backward_func(SlimPipeSettings(tuple(lengths), attention_backend=backend))
        reports = fb(
            forward_step_func=thd_forward_step if form == "thd" else forward_step,
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


def cp_document_cases(rank, world_size, cases):
    """Each case: (backend name, slice lengths, document lengths), b = 1. Returns per case this
    rank's global rows and, at those rows, out / dQ / dK / dV of the CP slice attention (float64)."""
    import torch.distributed as dist

    from megatron_slim.runtime.attention import ReferenceBackend, SdpaBackend
    from megatron_slim.runtime.pipeline.cp_slice_attention import cp_sliced_attention
    from megatron_slim.runtime.pipeline.kv_cache import KVCacheStore
    from megatron_slim.runtime.pipeline.slice_context import SliceInfo
    from megatron_slim.runtime.pipeline.zigzag import ZigzagLayout

    group = dist.new_group(list(range(world_size)))
    backends = {"reference": ReferenceBackend(), "sdpa": SdpaBackend()}
    results = []
    for index, (name, lengths, documents) in enumerate(cases):
        q, k, v, dout = document_qkv(index, sum(lengths))
        store, starts = KVCacheStore(), [sum(lengths[:j]) for j in range(len(lengths))]
        rows = [a + ZigzagLayout(world_size, n).positions(rank) for a, n in zip(starts, lengths)]
        pieces, outs = [], []
        for j, (a, n) in enumerate(zip(starts, lengths)):
            part = [t[rows[j]].unsqueeze(0).clone().requires_grad_() for t in (q, k, v)]
            info = SliceInfo(0, j, len(lengths), a, n)
            outs.append(
                cp_sliced_attention(
                    *part, backend=backends[name], softmax_scale=q.shape[-1] ** -0.5, group=group, store=store,
                    info=info, layer=1, documents=documents,
                )
            )  # fmt: skip
            pieces.append(part)
        for j in reversed(range(len(lengths))):
            outs[j].backward(dout[rows[j]].unsqueeze(0))
        result = {"rows": torch.cat(rows), "out": torch.cat([o.detach()[0] for o in outs]), "empty": store.is_empty()}
        for i, name in enumerate(("dq", "dk", "dv")):
            result[name] = torch.cat([p[i].grad[0] for p in pieces])
        results.append(result)
    return results


def document_qkv(seed: int, s: int, hq=4, hkv=2, d=8):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(s, h, d, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv, hq))


def _cp_forward_step(cp_group, data_iterator, model):
    """pretrain_gpt's shape: the batch's tensors through megatron's CP split, the CP-exact loss."""
    import functools

    from megatron.core.utils import get_batch_on_this_cp_rank

    from tests.runtime.pipeline._cp_workers import cp_loss_func

    batch = {name: value for name, value in next(data_iterator).items() if torch.is_tensor(value)}
    batch = get_batch_on_this_cp_rank(batch, cp_group=cp_group)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, functools.partial(cp_loss_func, batch["loss_mask"], cp_group=cp_group)


def run_packed_cp(rank, world_size, configs, seed=1234):
    """pp2 x cp2 on 4 ranks. Each config: (vpp, slice_lengths, windows, backend). Returns per config
    (token-weighted loss summed over CP, DDP-averaged grads, reference (loss, grads) on rank 0)."""
    import functools

    import torch.distributed as dist

    from megatron_slim.megatron.model.gpt import build_rank_chunks, global_grads
    from megatron_slim.megatron.model.parallel import init_model_parallel, teardown
    from megatron_slim.megatron.slimpipe.schedule import SlimPipeSettings, make_forward_backward_func
    from megatron_slim.megatron.slimpipe.slicing import SliceCoreAttention
    from tests.runtime.pipeline._cp_workers import _ddp_average

    model = ModelConfig(**TINY_GQA_8L)
    solo = init_model_parallel()
    refs = [
        reference.per_document_step(model, solo, _packs(make_packed_batches(model, w, seed), w), seed)
        if rank == 0
        else None
        for _, _, w, _ in configs
    ]
    teardown()
    groups = init_model_parallel(pp=2, cp=2)
    results = []
    for (vpp, lengths, windows, backend), ref in zip(configs, refs):
        batches = make_packed_batches(model, windows, seed)
        chunks = build_rank_chunks(
            model, dataclasses.replace(groups, vpp=vpp), core_attention=SliceCoreAttention, seed=seed
        )
        fb = make_forward_backward_func(SlimPipeSettings(tuple(lengths), attention_backend=backend))
        reports = fb(
            forward_step_func=functools.partial(_cp_forward_step, groups.cp),
            data_iterator=[iter(batches) for _ in chunks],
            model=chunks,
            num_microbatches=len(batches),
            seq_length=model.seq_length,
            micro_batch_size=1,
        )
        loss = None
        if reports:
            total = torch.stack([r["lm loss"] for r in reports]).sum(0)
            dist.all_reduce(total, group=groups.cp)
            loss = total[0] / total[1]
        grads = {}
        for c in chunks:
            grads.update(global_grads(c))
        results.append((loss, _ddp_average(grads, groups.cp), ref))
    teardown()
    return results
