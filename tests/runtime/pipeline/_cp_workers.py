"""Rank functions for the SlimPipe x context-parallelism tests (module level so spawn imports them)."""

import functools

import torch
import torch.distributed as dist

from megatron_slim.plan.recipe import ModelConfig
from megatron_slim.train.microbatch import loss_func
from tests.oracle import reference
from tests.oracle.models import TINY_GQA_8L
from tests.runtime.pipeline import _workers


# ---- the CP slice attention alone ------------------------------------------------------------
def _qkv(seed: int, s: int, b=2, hq=4, hkv=2, d=8):
    g = torch.Generator().manual_seed(seed)
    q, k, v, w = (torch.randn(b, s, h, d, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv, hq))
    return q, k, v, w


def attention_cases(rank, world_size, cases):
    """Each case: (backend name, slice lengths). Returns per case this rank's rows of the output and
    of dQ/dK/dV (global positions, float64) plus the store's state after the backward."""
    from megatron_slim.runtime.attention import ReferenceBackend, SdpaBackend
    from megatron_slim.runtime.pipeline.cp_slice_attention import cp_sliced_attention
    from megatron_slim.runtime.pipeline.kv_cache import KVCacheStore
    from megatron_slim.runtime.pipeline.slice_context import SliceInfo
    from megatron_slim.runtime.pipeline.zigzag import ZigzagLayout

    group = dist.new_group(list(range(world_size)))
    backends = {"reference": ReferenceBackend(), "sdpa": SdpaBackend()}
    results = []
    for index, (name, lengths) in enumerate(cases):
        backend = backends[name]
        q, k, v, w = _qkv(index, sum(lengths))
        store = KVCacheStore()
        starts = [sum(lengths[:j]) for j in range(len(lengths))]
        rows = [a + ZigzagLayout(world_size, n).positions(rank) for a, n in zip(starts, lengths)]
        pieces, outs = [], []
        for j, (a, n) in enumerate(zip(starts, lengths)):
            qs, ks, vs = (t[:, rows[j]].clone().requires_grad_() for t in (q, k, v))
            outs.append(
                cp_sliced_attention(
                    qs,
                    ks,
                    vs,
                    backend=backend,
                    softmax_scale=q.shape[-1] ** -0.5,
                    group=group,
                    store=store,
                    info=SliceInfo(0, j, len(lengths), a, n),
                    layer=3,
                )
            )
            pieces.append((qs, ks, vs))
        kv_bytes = store.live_bytes
        for j in reversed(range(len(lengths))):
            (outs[j] * w[:, rows[j]]).sum().backward()
        index_all = torch.cat(rows)
        cat = lambda ts: torch.cat(ts, 1)  # noqa: E731
        results.append(
            {
                "rows": index_all,
                "out": cat([o.detach() for o in outs]),
                "dq": cat([p[0].grad for p in pieces]),
                "dk": cat([p[1].grad for p in pieces]),
                "dv": cat([p[2].grad for p in pieces]),
                "kv_bytes": kv_bytes,
                "empty": store.is_empty() and store.live_bytes == 0,
            }
        )
        # the same tokens as one uncached sequence (no slice context), and forward-only
        whole = ZigzagLayout(world_size, sum(lengths)).positions(rank)
        with torch.no_grad():
            nograd = cp_sliced_attention(
                q[:, whole], k[:, whole], v[:, whole], backend=backend, softmax_scale=q.shape[-1] ** -0.5, group=group
            )
        results[-1].update(whole_rows=whole, whole_out=nograd)
    return results


# ---- SlimPipe x CP on megatron-core chunks ---------------------------------------------------
def cp_loss_func(loss_mask, output_tensor, cp_group):
    """Per-token mean over the whole microbatch under megatron's CP semantics: megatron divides by the
    returned ``num_tokens`` and DDP averages over the CP ranks, so return ``cp * local_sum`` and the
    CP group's total count (what ``megatron_slim.megatron.cp.data.cp_loss_func`` does)."""
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.float().reshape(-1)
    local_sum = torch.sum(losses * mask)
    count = mask.sum().detach().to(torch.int)
    report = {"lm loss": torch.cat([local_sum.detach().view(1), count.float().view(1)])}
    total = count.clone()
    dist.all_reduce(total, group=cp_group)
    return local_sum * dist.get_world_size(cp_group), total, report


def legacy_loss_func(loss_mask, output_tensor, cp_group):
    """Old pretrain_gpt.py style 2-tuple: the CP group's mean (count all-reduced, local graph);
    megatron multiplies it by cp before DDP averages over the CP ranks."""
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.float().reshape(-1)
    local_sum = torch.sum(losses * mask)
    count = mask.sum().detach()
    total = count.clone()
    dist.all_reduce(total, group=cp_group)
    report = {"lm loss": torch.cat([local_sum.detach().view(1), count.view(1)])}
    return local_sum / total, report


def _forward_step(loss_kind, cp_group, data_iterator, model):
    from megatron.core.utils import get_batch_on_this_cp_rank

    batch = get_batch_on_this_cp_rank(dict(next(data_iterator)), cp_group=cp_group)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    if loss_kind == "stock":
        return output, functools.partial(loss_func, batch["loss_mask"])
    fn = cp_loss_func if loss_kind == "cp" else legacy_loss_func
    return output, functools.partial(fn, batch["loss_mask"], cp_group=cp_group)


def _ddp_average(grads: dict, cp_group) -> dict:
    """What megatron's DDP does to a CP rank's gradients (dp=1): sum over dp x cp, times 1/(dp x cp)."""
    cp = dist.get_world_size(cp_group)
    for g in grads.values():
        if g is not None:
            dist.all_reduce(g, group=cp_group)
            g.div_(cp)
    return grads


def cp_step(fb, chunks, batches, m: int, seq_length: int, loss_kind: str, cp_group):
    """One SlimPipe call under CP: the CP-summed lm losses and the CP-averaged global gradients."""
    from megatron_slim.megatron.model.gpt import global_grads

    reports = fb(
        forward_step_func=functools.partial(_forward_step, loss_kind, cp_group),
        data_iterator=[iter(batches) for _ in chunks],
        model=chunks,
        num_microbatches=m,
        seq_length=seq_length,
        micro_batch_size=2,
    )
    grads = {}
    for c in chunks:
        grads.update(global_grads(c))
    losses = [r["lm loss"].clone() for r in reports]
    for loss in losses:
        dist.all_reduce(loss, group=cp_group)
    return losses, _ddp_average(grads, cp_group)


def _batches(model, m, loss_kind, seed):
    batches = _workers.make_batches(model, m, micro_batch=2, seed=seed + m)
    if loss_kind == "stock":  # megatron's per-rank normalisation equals the reference iff counts match
        batches = [dict(b, loss_mask=torch.ones_like(b["loss_mask"])) for b in batches]
    return batches


def run_slimpipe_cp(rank, world_size, layouts, seed=1234, exchange=False):
    """``layouts``: ``[(tp, pp, cp, configs)]`` run one after the other on the same ranks; each config
    is (vpp, num_microbatches, slice_lengths, loss kind in {"cp", "stock", "legacy"}). Returns per
    layout and config (reports summed over CP, DDP-averaged grads by global name (this rank's TP
    shards), tp rank, reference (reports, grads cut to this TP rank's shards) on CP rank 0 of the
    first stage, else None); with ``exchange`` (context exchange on) each result also holds the K/V
    rows this rank shipped to exchange peers and the schedule's pairing text.

    References run first, under a model-parallel state of size 1 (megatron reads the TP group from
    ``parallel_state`` in places, e.g. the vocab-parallel cross entropy)."""
    from megatron_slim.megatron.model.parallel import init_model_parallel, teardown

    model = ModelConfig(**TINY_GQA_8L)
    solo = init_model_parallel()
    refs = [
        [
            reference.unsliced_step(model, solo, _batches(model, m, kind, seed), seed) if rank < tp else None
            for _, m, _, kind in configs
        ]
        for tp, _, _, configs in layouts
    ]
    teardown()
    out = []
    for (tp, pp, cp, configs), layout_refs in zip(layouts, refs):
        out.append(_run_layout(rank, model, tp, pp, cp, configs, layout_refs, seed, exchange))
        teardown()
    return out


def _run_layout(rank, model, tp, pp, cp, configs, refs, seed, exchange=False):
    import dataclasses

    from megatron_slim.megatron.model.gpt import build_chunk, build_rank_chunks, global_named_parameters
    from megatron_slim.megatron.model.parallel import init_model_parallel
    from megatron_slim.megatron.model.weights import tp_shard
    from megatron_slim.megatron.slimpipe.call_plan import planned_schedule
    from megatron_slim.megatron.slimpipe.schedule import SlimPipeSettings, make_forward_backward_func
    from megatron_slim.megatron.slimpipe.slicing import SliceCoreAttention

    groups = init_model_parallel(tp=tp, pp=pp, cp=cp)
    # megatron's rank order is tp-cp-dp-pp: ranks < tp are CP rank 0 of stage 0, DP replica 0
    assert (rank < tp) == (groups.cp_rank == 0 and groups.pp_rank == 0 and groups.dp_rank == 0)
    params = {}
    if rank < tp and tp > 1:  # megatron's sharding metadata of every parameter
        whole = build_chunk(
            model,
            groups,
            layers=range(model.num_layers),
            pre_process=True,
            post_process=True,
            core_attention=SliceCoreAttention,
            seed=seed,
        )
        params = global_named_parameters(whole)
    results = []
    for (vpp, m, lengths, loss_kind), ref in zip(configs, refs):
        batches = _batches(model, m, loss_kind, seed)
        chunks = build_rank_chunks(
            model, dataclasses.replace(groups, vpp=vpp), core_attention=SliceCoreAttention, seed=seed
        )
        settings = SlimPipeSettings(tuple(lengths), exchange=exchange)
        fb = make_forward_backward_func(settings)
        reports, grads = cp_step(fb, chunks, batches, m, model.seq_length, loss_kind, groups.cp)
        if ref is not None and params:
            ref = (ref[0], {n: tp_shard(g, params[n], groups.tp_rank, tp) for n, g in ref[1].items()})
        result = (reports, grads, groups.tp_rank, ref)
        if exchange:
            result += (fb.stats.exchanged_tokens, planned_schedule(settings, pp, vpp, m).exchange)
        results.append(result)
    return results
