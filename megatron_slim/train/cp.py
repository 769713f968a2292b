"""Context parallelism in ``megatron-slim train``: ``cp.engine`` runs every microbatch as a planned pack.

With ``parallel.cp > 1`` each microbatch window of ``model.seq_length`` tokens is a *pack* whose
sequences are the documents between the tokenizer's ``eod`` tokens (``megatron.cp.lengths.document_lengths``;
a document includes its ``eod``): attention stays inside each document and positions restart at
0 in each, the THD semantics every CP engine needs -- not the plain causal window of ``cp=1``.

Per iteration, every rank of a CP group derives the same lengths from the same windows and plans
each microbatch (``megatron.cp.data.plan_microbatch``: placement, routing and, with ``cp.remap``, the remap
plan, exactly what the CP simulator prices). Every window runs under every engine: a CP rank that
a plan leaves without tokens (one-token documents under ring / allgather / a2a+p2p) takes part in
every collective and runs one masked padding row (``megatron.cp.padding``). The forward step then, before every
microbatch's forward, makes that plan current on the chunk's ``CPContext`` (collective: the CP
ranks compare plan hashes), cuts the window to this rank's tokens (``megatron.cp.data.cp_batch``) and
returns ``megatron.cp.data.cp_loss_func``: the loss is ``cp * local_sum`` over the CP-wide masked-token
count, so the schedule's per-microbatch normalisation and the loop's gradient *average* over data
x context parallel ranks give the single-process reference's gradients (mean over each pack's loss
tokens, averaged over microbatches and data-parallel ranks).

Pipeline parallelism (``parallel.pp > 1``). Every pipeline stage reads the same windows (the loop
gives every rank its data-parallel rank's microbatches) and plans them itself, and the stages of
a pipeline compare one digest of the iteration's plans (collective over the pipeline group); the
CP ranks of each stage still compare every plan in ``set_plan``. Every stage runs the same forward
step: it makes the microbatch's plan current (its attention program, rotary positions and remap)
before the chunk's forward. The hidden states crossing a stage boundary are this CP rank's tokens
in the plan's *attention layout* (``RankLayout`` order, plus the padding row of an empty rank):
the remap layer moves rows to the token-balanced layout only around each layer's MLP and back
before the layer returns, so every layer boundary, the stage boundary included, holds the
attention layout. ``stage_rows`` gives the schedule those per-microbatch row counts for its
receive buffers. A backward needs no current plan: the engine's and the remap's autograd nodes
keep the plan they ran forward with, so 1F1B's interleaved forwards and backwards stay exact.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_slim.plan.recipe import Recipe
from megatron_slim.runtime.agreement import check_agreement
from megatron_slim.train.checks import check_cp_trainable, cp_topology

MICROBATCH_KEY = "cp_microbatch"  # carried through the schedule's data iterator to find the plan


def cp_layer_classes(recipe: Recipe) -> dict[str, Optional[type]]:
    """``build_chunk`` keywords: the CP engine's core attention (schedule-adapter form) and, with
    ``cp.remap``, the remapping transformer layer."""
    from megatron_slim.megatron.cp.remap_layer import RemapTransformerLayer
    from megatron_slim.megatron.cp.schedule import CPScheduledCoreAttention

    return {
        "core_attention": CPScheduledCoreAttention,
        "transformer_layer": RemapTransformerLayer if recipe.cp.remap else None,
    }


class CPTrainStep:
    """One rank's CP plumbing: the iteration's plans, the forward step, the plan summary."""

    def __init__(self, recipe: Recipe, groups, eod: int) -> None:
        from megatron_slim.megatron.cp.attention import CPContext

        self.engine, self.remap = recipe.cp.engine, recipe.cp.remap
        self.topo, self.costs = cp_topology(recipe)
        self.cp_group, self.cp_rank = groups.cp, groups.cp_rank
        self.pp_group = groups.pp if groups.pp_size > 1 else None
        self.context = CPContext(groups.cp)
        self.eod = eod
        self.plans: list[tuple] = []

    def attach(self, chunks) -> None:
        from megatron_slim.megatron.cp.attention import attach_context_parallel

        for c in chunks:
            if attach_context_parallel(c, self.context) == 0:
                raise RuntimeError(
                    "cp.engine: the model chunk has no CPCoreAttention (build it with train.cp.cp_layer_classes)"
                )

    def plan_iteration(self, microbatches: list[dict]) -> list[dict]:
        """Plan every microbatch window of this iteration; returns the windows tagged with their index."""
        from megatron_slim.megatron.cp.data import plan_microbatch
        from megatron_slim.megatron.cp.lengths import document_lengths

        self.plans = [
            plan_microbatch(
                document_lengths(b["tokens"], self.eod), self.topo, self.costs, engine=self.engine, remap=self.remap
            )
            for b in microbatches
        ]
        if self.pp_group is not None:
            check_agreement(
                self.plans_digest(),
                self.pp_group,
                device=self.context.device,
                ranks="pipeline ranks",
                what="iteration's CP plans",
                remedy="every pipeline stage must plan the same windows with the same recipe",
            )
        return [{**b, MICROBATCH_KEY: k} for k, b in enumerate(microbatches)]

    def plans_digest(self) -> str:
        """One sha256 over the fingerprints of this iteration's plans (placement, routing, remap)."""
        from megatron_slim.megatron.cp.window_slices import plans_digest

        return plans_digest(self.plans)

    def stage_rows(self, microbatch: int, slice_: int) -> int:
        """Rows of this CP rank's hidden states between pipeline stages for ``microbatch`` (one
        slice): the plan's tokens in attention layout, or one padding row (``cp.padding``)."""
        from megatron_slim.megatron.cp.padding import padding_rows

        plan = self.plans[microbatch][0]
        return plan.ranks[self.cp_rank].num_tokens + padding_rows(plan, self.cp_rank)

    def forward_step(self, data_iterator, model):
        from megatron_slim.megatron.cp.data import cp_batch, cp_loss_func

        batch = dict(next(data_iterator))
        k = batch.pop(MICROBATCH_KEY)
        plan, routing, remap = self.plans[k]
        self.context.set_plan(plan, routing=routing, remap=remap)
        local = cp_batch(batch, plan, self.cp_rank)
        output = model(local["tokens"], local["position_ids"], None, labels=local["labels"])
        return output, functools.partial(cp_loss_func, local["loss_mask"], cp_group=self.cp_group)

    def vocab_forward_step(self, data_iterator, model):
        """``forward_step`` under ``schedule.vocab_parallel``: the last stage's final hidden states and
        this CP rank's ``(labels, loss_mask)``, cut in the same layout (``runtime/pipeline/vocab.py``)."""
        from megatron_slim.megatron.cp.data import cp_batch
        from megatron_slim.megatron.model.vocab_head import final_hidden_states
        from megatron_slim.train.microbatch import vocab_targets

        batch = dict(next(data_iterator))
        plan, routing, remap = self.plans[batch.pop(MICROBATCH_KEY)]
        self.context.set_plan(plan, routing=routing, remap=remap)
        local = cp_batch(batch, plan, self.cp_rank)
        with final_hidden_states(model):
            output = model(local["tokens"], local["position_ids"], None)
        return output, functools.partial(vocab_targets, local["labels"], local["loss_mask"])

    def summary(self) -> dict[str, int]:
        """This iteration's plans in counts: packs, sequences by scope, packs that leave a CP rank
        without tokens (``padded``: it runs a masked padding row), tokens per rank."""
        out = {
            "packs": len(self.plans),
            "sequences": 0,
            "local": 0,
            "intra": 0,
            "inter": 0,
            "padded": 0,
            "max_tokens_per_rank": 0,
            "min_tokens_per_rank": 0,
            "remapped_tokens": 0,
        }
        lows = []
        for plan, _, remap in self.plans:
            out["sequences"] += len(plan.lengths)
            for g in plan.groups:
                out[g.scope] += len(g.seqs)
            tokens = plan.tokens_per_rank()
            out["padded"] += int(min(tokens) == 0)
            out["max_tokens_per_rank"] = max(out["max_tokens_per_rank"], max(tokens))
            lows.append(min(tokens))
            out["remapped_tokens"] += remap.moved_tokens if remap is not None else 0
        out["min_tokens_per_rank"] = min(lows) if lows else 0
        return out


_SUMMED = ("packs", "sequences", "local", "intra", "inter", "padded", "remapped_tokens")


def reduce_summary(summary: dict[str, int], dp_group: Any, dp_size: int) -> dict[str, int]:
    """The summary over every data-parallel rank's microbatches (collective over ``dp_group``)."""
    if dp_size == 1:
        return dict(summary)
    sums = torch.tensor([summary[k] for k in _SUMMED], dtype=torch.long)
    extremes = torch.tensor([summary["max_tokens_per_rank"], -summary["min_tokens_per_rank"]], dtype=torch.long)
    dist.all_reduce(sums, group=dp_group)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=dp_group)
    out = dict(zip(_SUMMED, sums.tolist()))
    out["max_tokens_per_rank"], out["min_tokens_per_rank"] = extremes[0].item(), -extremes[1].item()
    return out


def summary_text(engine: str, s: dict[str, int]) -> str:
    """``cp zeppelin: 9 seqs 6 local/2 intra/1 inter, 96-160 tok/rank`` (+ packs leaving a rank empty)."""
    text = (
        f"cp {engine}: {s['sequences']} seqs {s['local']} local/{s['intra']} intra/{s['inter']} inter, "
        f"{s['min_tokens_per_rank']}-{s['max_tokens_per_rank']} tok/rank"
    )
    if s["padded"]:
        text += f", {s['padded']} pack(s) left a CP rank without tokens (it ran a masked padding row)"
    return text


def describe(recipe: Recipe) -> str:
    """One line for the start of a run: engine, topology and the document-masking semantics."""
    if recipe.exchange_cp:
        return (
            f"context parallel: cp{recipe.parallel.cp} by SlimPipe's query-out slice attention (cp.engine=ring "
            "names it, no engine plans windows) under context exchange: each slice of a plain causal window is "
            "split zigzag-wise over the CP ranks, attention runs across the whole window as with parallel.cp=1"
        )
    if recipe.query_out_cp:
        return (
            f"context parallel: cp{recipe.parallel.cp} by SlimPipe's query-out slice attention (no cp.engine): "
            f"each slice of a packed window ({recipe.data.packing}) is split zigzag-wise over the CP ranks, "
            "attention stays inside each of the window's documents"
            + (
                "; SlimPack's CP-routed outliers run alone in a window under Zeppelin's placement"
                if recipe.cp_routes
                else ""
            )
        )
    topo, _ = cp_topology(recipe)
    remap = " with remap" if recipe.cp.remap else ""
    s = recipe.schedule
    sliced = (
        f"; its {s.num_slices} SlimPipe slices follow that plan" if s.kind == "slimpipe" and s.num_slices > 1 else ""
    )
    return (
        f"context parallel: cp{recipe.parallel.cp} engine {recipe.cp.engine}{remap} on {topo.num_nodes} node(s) "
        f"x {topo.ranks_per_node} CP ranks (hardware {recipe.hardware_profile.name}); each microbatch is a "
        f"pack of the documents between eod tokens, attention stays inside each document{sliced}"
    )


__all__ = [
    "CPTrainStep",
    "MICROBATCH_KEY",
    "check_cp_trainable",
    "cp_layer_classes",
    "cp_topology",
    "describe",
    "reduce_summary",
    "summary_text",
]
