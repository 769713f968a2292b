"""``data.packing`` in ``megatron-slim train``: the iteration's documents, packed by the chosen method
(``plan/pack/training.py``), as microbatch windows of ``seq_length`` tokens, and their loss.

A window (b=1) is its pieces back to back, then padding (``loss_mask`` 0). ``position_ids`` restart
at 0 in every sample (at the piece's start for a continued piece) and in the padding; ``labels`` are
the next token within the document (its last token is masked). ``document_lengths`` lists the
window's documents in order with the padding as the last one: slice attention that honours it keeps
attention inside each document.

Loss. Microbatches differ in loss tokens and DP ranks in microbatch count, so Megatron's per-
microbatch mean would weigh tokens unevenly. The iteration's loss is every loss token's loss over
the number of loss tokens of the whole global batch (``N``, known from the plan on every rank, no
collective): the same for every method on the same documents. The schedule divides a microbatch's
loss by its token count and by this rank's microbatch count ``m``, and the gradients are then
averaged over ``dp`` ranks, so each window's loss is multiplied by ``dp * tokens * m / N``.

Context parallelism (``parallel.cp > 1``, ``Recipe.query_out_cp``): no CP engine runs; every slice of
a window is split zigzag-wise over the CP ranks and SlimPipe's query-out CP slice attention keeps to
the window's documents across slices. Each CP rank sums only its tokens' losses while the schedule
still divides by the whole slice's tokens, and gradients are averaged over ``dp * cp`` ranks, so a
CP rank's window loss is multiplied by ``cp`` as well (``packed_cp_forward_step``).
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import numpy
import torch

from megatron_slim.plan.cost.model import CostModel
from megatron_slim.plan.cp.estimate import ZeppelinLayers
from megatron_slim.plan.pack.costs import fit_slice_costs
from megatron_slim.plan.pack.cp_route import CPRoute
from megatron_slim.plan.pack.plan import Piece
from megatron_slim.plan.pack.training import (
    IterationPacking,
    Sample,
    Window,
    cut_samples,
    iteration_samples,
    pack_iteration,
)
from megatron_slim.plan.recipe import Recipe
from megatron_slim.plan.sim.costs import slice_lengths
from megatron_slim.runtime.agreement import check_agreement


def window_batch(window: Window, samples: Sequence[Sample], documents: Sequence, seq_length: int) -> dict:
    """The window's ``[1, seq_length]`` tensors and its ``document_lengths``; ``documents[d]`` is
    document ``d``'s token ids."""
    tokens = numpy.zeros(seq_length, dtype=numpy.int64)
    labels = numpy.zeros(seq_length, dtype=numpy.int64)
    loss_mask = numpy.zeros(seq_length, dtype=numpy.float32)
    position_ids = numpy.zeros(seq_length, dtype=numpy.int64)
    at = 0
    for p in window.pieces:
        at = _place(p, samples[p.sample], documents, at, (tokens, labels, loss_mask, position_ids))
    position_ids[at:] = numpy.arange(seq_length - at)
    return {
        "tokens": torch.from_numpy(tokens).unsqueeze(0),
        "labels": torch.from_numpy(labels).unsqueeze(0),
        "loss_mask": torch.from_numpy(loss_mask).unsqueeze(0),
        "position_ids": torch.from_numpy(position_ids).unsqueeze(0),
        "document_lengths": window.document_lengths,
    }


def _place(piece: Piece, sample: Sample, documents: Sequence, at: int, out: tuple) -> int:
    tokens, labels, loss_mask, position_ids = out
    doc = documents[sample.document]
    begin, n = sample.offset + piece.start, piece.length
    tokens[at : at + n] = doc[begin : begin + n]
    following = doc[begin + 1 : begin + n + 1]  # one shorter where the document ends
    labels[at : at + len(following)] = following
    loss_mask[at : at + len(following)] = 1.0
    position_ids[at : at + n] = piece.start + numpy.arange(n)
    return at + n


def packed_loss_func(
    loss_mask: torch.Tensor, weight: float, output_tensor: torch.Tensor, counted: Optional[torch.Tensor] = None
):
    """``loss_func`` with the loss scaled by ``weight``; the report keeps the plain sum and count.
    ``counted``: the token count the schedule divides by (default: ``loss_mask``'s)."""
    losses = output_tensor.float()
    loss = torch.sum(losses.reshape(-1) * loss_mask.reshape(-1))
    num_tokens = loss_mask.sum().to(torch.int)
    divisor = num_tokens if counted is None else counted.to(torch.int)
    return loss * weight, divisor, {"lm loss": torch.cat([loss.detach().view(1), num_tokens.float().view(1)])}


def packed_forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, functools.partial(packed_loss_func, batch["loss_mask"], batch["loss_weight"])


def packed_cp_forward_step(cp_group, data_iterator, model):
    """``packed_forward_step`` under SlimPipe's query-out CP attention: the slice is cut zigzag-wise to
    this CP rank's tokens (Megatron's ``get_batch_on_this_cp_rank`` split, which ``SliceRotary`` and the
    CP slice attention assume). The schedule divides by the whole slice's loss tokens (no collective)
    and the loss is ``cp`` times this rank's share, so averaging gradients over the CP ranks sums them."""
    return packed_cp_batch_step(cp_group, next(data_iterator), model)


def packed_cp_batch_step(cp_group, batch: dict, model):
    """``packed_cp_forward_step`` of a batch already read."""
    from megatron_slim.megatron.model.rotary import zigzag_positions

    cp = cp_group.size()
    rows = zigzag_positions(batch["tokens"].shape[1], cp_group.rank(), cp)
    local = {name: batch[name][:, rows] for name in ("tokens", "labels", "loss_mask", "position_ids")}
    output = model(local["tokens"], local["position_ids"], None, labels=local["labels"])
    weight, counted = batch["loss_weight"] * cp, batch["loss_mask"].sum()
    return output, functools.partial(packed_loss_func, local["loss_mask"], weight, counted=counted)


def zigzag_cp_forward_step(cp_group, data_iterator, model):
    """``forward_step`` of a plain causal window (``data.packing=none``) under SlimPipe's query-out CP,
    context exchange's CP path (``Recipe.exchange_cp``): ``packed_cp_batch_step`` at unit weight, so
    each slice's loss is ``cp`` times this rank's sum over the whole slice's loss tokens."""
    return packed_cp_batch_step(cp_group, {**next(data_iterator), "loss_weight": 1.0}, model)


class PackedData:
    """The corpus's documents in a seeded order, packed one iteration at a time."""

    def __init__(self, recipe: Recipe, documents: Sequence, dp: int) -> None:
        self.recipe, self.dp = recipe, dp
        order = numpy.random.RandomState(recipe.train.seed).permutation(len(documents))
        self.documents = [documents[i] for i in order]
        seq = recipe.model.seq_length
        self.samples = cut_samples(range(len(self.documents)), [len(d) for d in self.documents], seq)
        self.sample_lengths = [s.length for s in self.samples]
        cost = CostModel(recipe)
        self.costs = fit_slice_costs(cost, seq, seq)
        # the route is priced as train runs it: Zeppelin's placement without its remap layer
        self.cp_route = CPRoute.from_cost_model(cost, seq, ZeppelinLayers(remap=False)) if recipe.cp_routes else None
        # DP-merge is offered only where train runs it, checked against the run's own slices
        self.merge_slices = slice_lengths(recipe, cost) if recipe.dp_merge else None

    def iteration(self, iteration: int) -> IterationPacking:
        """0-based ``iteration``'s packing (identical on every rank)."""
        r = self.recipe
        budget = r.train.global_batch_size * r.model.seq_length
        taken = iteration_samples(self.sample_lengths, budget, iteration)
        samples = [self.samples[i] for i in taken]
        seq = r.model.seq_length
        return pack_iteration(r.data.packing, samples, self.costs, self.dp, seq, self.cp_route, self.merge_slices)

    def step(self, iteration: int, dp_rank: int) -> tuple[IterationPacking, list[dict]]:
        """0-based ``iteration``'s packing and DP rank ``dp_rank``'s microbatches."""
        packing = self.iteration(iteration)
        return packing, self.batches(packing, dp_rank)

    def batches(self, packing: IterationPacking, dp_rank: int) -> list[dict]:
        """DP rank ``dp_rank``'s microbatches, each with its ``loss_weight``."""
        seq, windows = self.recipe.model.seq_length, packing.windows[dp_rank]
        out = []
        for w in windows:
            batch = window_batch(w, packing.samples, self.documents, seq)
            tokens = max(1.0, float(batch["loss_mask"].sum()))
            batch["loss_weight"] = self.dp * tokens * len(windows) / max(1, packing.loss_tokens)
            out.append(batch)
        return out


def iteration_batches(data, recipe: Recipe, number: int, dp_rank: int, cp_group=None, routed=None, merge=None):
    """Iteration ``number`` (from 1) on DP rank ``dp_rank``: (its packing or None, its microbatches, the
    forward step that reads them). ``cp_group``: packed windows, or plain windows under context exchange
    (``Recipe.exchange_cp``), run SlimPipe's query-out CP over it;
    ``routed`` (``packed_routes.RoutedWindows``): CP-routed windows run Zeppelin's placement instead;
    ``merge`` (``runtime/pipeline/dp_merge.MergeLink``): is told the iteration's DP-merge transfers."""
    from megatron_slim.train.microbatch import forward_step, microbatches

    if isinstance(data, PackedData):
        packing, batches = data.step(number - 1, dp_rank)
        if torch.distributed.is_initialized():
            what, remedy = "packing plan", "every rank plans the same samples with the same deterministic planner"
            check_agreement(packing.plan.digest(), None, ranks="ranks", what=what, remedy=remedy)
        step = functools.partial(packed_cp_forward_step, cp_group) if cp_group is not None else packed_forward_step
        if routed is not None:
            routed.prepare(packing, dp_rank)
            step = routed.forward_step
        if merge is not None:
            merge.prepare(packing.merges, dp_rank)
        return packing, batches, step
    step = forward_step if cp_group is None else functools.partial(zigzag_cp_forward_step, cp_group)
    return None, list(microbatches(data, recipe, number - 1, dp_rank)), step


def training_data(recipe: Recipe, prepared):
    """``data.packing=none``: megatron-core's ``GPTDataset`` windows; else the packed documents."""
    from megatron_slim.megatron.data import build_gpt_dataset, read_token_documents

    t = recipe.train
    if recipe.data.packing == "none":
        return build_gpt_dataset(prepared, recipe.model.seq_length, t.global_batch_size * t.iters, seed=t.seed)
    return PackedData(recipe, read_token_documents(prepared.path_prefix), recipe.parallel.dp)
