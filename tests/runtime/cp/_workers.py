"""Rank functions for the CP runtime tests (module level so ``run_ranks`` can spawn them)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.oracle import reference
from tests.oracle.models import TINY_GQA_2L_LONG
from tests.runtime.cp import _plans

HQ, HKV, D = 4, 2, 8


def pack_tensors(length: int, dv: int, dtype: torch.dtype, seed: int):
    """Full-pack q, k, v and upstream gradient, identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(length, HQ, D, generator=g), torch.randn(length, HKV, D, generator=g)
    v, dout = torch.randn(length, HKV, dv, generator=g), torch.randn(length, HQ, dv, generator=g)
    return tuple(t.to(dtype) for t in (q, k, v, dout))


def layout_index(plan, rank: int) -> torch.Tensor:
    """Pack positions of ``rank``'s tokens in its attention-layout order."""
    return torch.tensor(
        [s.pack_start + i for s in plan.ranks[rank].segments for i in range(s.length)], dtype=torch.long
    )


def engine_cases(rank, world_size, names, dtype_name, backend_name, dv, seed=7):
    """Run the engine on every named plan; return this rank's rows of out/dq/dk/dv per case."""
    from megatron_slim.runtime.attention import select_backend
    from megatron_slim.runtime.cp import CPAttentionEngine
    from megatron_slim.runtime.cp.run_context import HeadShape

    dtype = getattr(torch, dtype_name)
    backend = select_backend(backend_name, dtype=dtype)
    engine = CPAttentionEngine(dist.group.WORLD)
    results = {}
    for name in names:
        plan, routing = _plans.case(name)
        engine.prepare(plan, routing)
        engine.trace = {}
        q, k, v, dout = pack_tensors(plan.pack_length, dv, dtype, seed)
        idx = layout_index(plan, rank)
        ql, kl, vl = (t[idx].clone().requires_grad_() for t in (q, k, v))
        out = engine(ql, kl, vl, backend=backend)
        out.backward(dout[idx])
        program = engine.program(HeadShape(HQ, HKV, D, dv))
        results[name] = {
            "index": idx,
            "out": out.detach(),
            "dq": ql.grad,
            "dk": kl.grad,
            "dv": vl.grad,
            "program": program.describe(),
            "steps": engine.trace,
            "relay_tasks": sum(t.rows is None for t in program.tasks),
        }
    return results


FP32_CASES = ("zeppelin", "zeppelin-routed", "ring", "hierarchical", "ulysses", "relay")
REMAP_CASES = ("skewed", "zeppelin", "dynamic", "zeppelin-spread", "zeppelin-ulysses")


def engine_suite(rank, world_size):
    """Everything the engine and remap tests check, in one spawn (spawning 4 ranks costs ~10 s)."""
    return {
        "float64": engine_cases(rank, world_size, _plans.CASES, "float64", "reference", dv=6),
        "float32": engine_cases(rank, world_size, FP32_CASES, "float32", "sdpa", dv=D),
        "disagree": disagreeing_plans(rank, world_size),
        "remap": remap_cases(rank, world_size, REMAP_CASES),
        "profiled": profiled_cases(rank, world_size, PROFILED_CASES),
    }


PROFILED_CASES = ("zeppelin-routed", "relay", "hierarchical", "ulysses", "allgather")


def profiled_cases(rank, world_size, names):
    """Per plan, the ``cp ...`` events torch's profiler saw in one forward and backward, by start time."""
    from torch.profiler import ProfilerActivity, profile

    from megatron_slim.runtime.attention import select_backend
    from megatron_slim.runtime.cp import CPAttentionEngine

    engine = CPAttentionEngine(dist.group.WORLD)
    backend = select_backend("reference", dtype=torch.float64)
    results = {}
    for name in names:
        plan, routing = _plans.case(name)
        engine.prepare(plan, routing)
        q, k, v, dout = pack_tensors(plan.pack_length, D, torch.float64, seed=7)
        idx = layout_index(plan, rank)
        ql, kl, vl = (t[idx].clone().requires_grad_() for t in (q, k, v))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            engine(ql, kl, vl, backend=backend).backward(dout[idx])
        events = sorted(prof.events(), key=lambda e: e.time_range.start)
        results[name] = [e.name for e in events if e.name.startswith("cp ")]
    return results


def disagreeing_plans(rank, world_size):
    """Rank 0 prepares another plan than the others: every rank must raise, none may hang."""
    from megatron_slim.runtime.cp import CPAttentionEngine

    engine = CPAttentionEngine(dist.group.WORLD)
    plan, _ = _plans.case("ring" if rank == 0 else "allgather")
    try:
        engine.prepare(plan)
    except RuntimeError as exc:
        return str(exc)
    return None


def remap_cases(rank, world_size, names):
    """Move token ids to the balanced layout and back; gradient of a weighted sum after the move."""
    from megatron_slim.runtime.cp import Comm, remap_rows

    comm = Comm(dist.group.WORLD)
    results = {}
    for name in names:
        plan, _ = _plans.case(name)
        remap = _plans.remap_for(plan)
        ids = layout_index(plan, rank).double()
        x = torch.stack([ids, -ids, ids * 0.5], dim=1).unsqueeze(1).clone().requires_grad_()  # [T, 1, 3]
        y = remap_rows(x, remap, comm)
        weight = torch.stack(
            [torch.sin(y[:, 0, 0].detach()), torch.cos(y[:, 0, 0].detach()), y[:, 0, 0].detach() ** 2], dim=1
        ).unsqueeze(1)
        (y * weight).sum().backward()
        back = remap_rows(y.detach(), remap.inverse(), comm)
        results[name] = {"x": x.detach(), "y": y.detach(), "back": back, "grad": x.grad}
    return results


# --------------------------------------------------------------------------- megatron-core model


def make_pack(lengths, vocab: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    return {
        "tokens": torch.randint(0, vocab, (total,), generator=g),
        "labels": torch.randint(0, vocab, (total,), generator=g),
        "loss_mask": (torch.rand(total, generator=g) > 0.15).float(),
    }


def model_cases(rank, world_size, cases, seed=1234):
    """Each case ``(plan name, remap)``: a CP model step on every rank (megatron's loss normalisation,
    gradients averaged over the CP group as DDP does) and, on rank 0, the unsharded reference."""
    from megatron_slim.megatron.cp.attention import CPContext, attach_context_parallel, cp_layer_classes
    from megatron_slim.megatron.cp.data import cp_batch, cp_loss_func
    from megatron_slim.megatron.cp.remap_layer import RemapTransformerLayer
    from megatron_slim.megatron.model.gpt import build_chunk, global_grads
    from megatron_slim.megatron.model.parallel import init_model_parallel
    from megatron_slim.plan.recipe import ModelConfig

    groups = init_model_parallel(cp=world_size)
    solo = reference.solo_groups(rank, world_size)
    model_cfg = ModelConfig(**TINY_GQA_2L_LONG)
    references: dict = {}
    results = {}
    for name, remap_on in cases:
        plan, routing = _plans.case(name)
        remap = _plans.remap_for(plan) if remap_on else None
        pack = make_pack(plan.lengths, model_cfg.vocab_size, seed)
        chunk = build_chunk(
            model_cfg,
            groups,
            layers=range(model_cfg.num_layers),
            pre_process=True,
            post_process=True,
            seed=seed,
            **cp_layer_classes(remap=remap_on),
        )
        context = CPContext(groups.cp)
        found = attach_context_parallel(chunk, context)
        context.set_plan(plan, routing=routing, remap=remap)
        batch = cp_batch(pack, plan, rank)
        losses = chunk(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        loss, num_tokens, report = cp_loss_func(batch["loss_mask"], losses, groups.cp)
        (loss / num_tokens.clamp(min=1)).backward()  # megatron: / num_tokens / num_microbatches (1)
        grads = global_grads(chunk)
        for g in grads.values():
            dist.all_reduce(g, group=groups.cp)  # DDP over data x context parallel ranks averages
            g /= world_size
        pair = report["lm loss"].clone()
        dist.all_reduce(pair, group=groups.cp)
        results[name, remap_on] = {
            "loss": pair[0] / pair[1],
            "grads": grads if rank == 0 else None,
            "attentions": found,
            "remap_layers": sum(isinstance(m, RemapTransformerLayer) for m in chunk.modules()),
            "moved": remap.moved_tokens if remap is not None else 0,
        }
        if rank == 0:
            if plan.lengths not in references:
                references[plan.lengths] = reference.per_document_step(
                    model_cfg, solo, [dict(pack, lengths=plan.lengths)], seed
                )
            results[name, remap_on]["reference"] = references[plan.lengths]
    return results
