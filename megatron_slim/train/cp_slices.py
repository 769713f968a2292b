"""SlimPipe slices with a CP engine in ``megatron-slim train`` (``schedule.num_slices > 1``, ``cp.engine``).

The engine plans each microbatch window once, exactly as without slices (``train.cp.CPTrainStep``:
every pipeline stage plans, the stages agree on one digest). Every slice then follows that plan
(``plan/cp/slices.py``): slice ``j`` is a contiguous range of the window, and each CP rank holds
the positions of its planned segments inside it (one padding row where it holds none). The model's
core attention is SlimPipe's ``SliceCoreAttention``; for a planned window it runs query-out over
the plan's shares (``runtime/pipeline/cp_planned_attention.py``): a slice's queries read the
slice's K/V and the K/V every rank cached of the same documents' earlier slices, so a document the
plan keeps on one rank never meets keys elsewhere. RoPE restarts in every document
(``SliceRotary``). The windows carry their document lengths (``document_lengths``), which the
slicing data iterator records for attention and RoPE; the plan's shares go on the run's
``SliceContext.cp_shares``.

Loss: ``cp_loss_func`` per slice returns ``cp * local sum`` over the CP-wide count of the slice's
loss tokens; the schedule sums both over a microbatch's slices before dividing, which gives the
microbatch's CP-wide mean, as without slices.
"""

from __future__ import annotations

import functools
from typing import Sequence

from megatron_slim.megatron.cp.window_slices import rows_of_share, window_shares
from megatron_slim.plan.cp.slices import SliceShare
from megatron_slim.plan.recipe import Recipe
from megatron_slim.runtime.pipeline.documents import DOCUMENT_LENGTHS
from megatron_slim.runtime.pipeline.slice_context import SliceContext
from megatron_slim.train.cp import MICROBATCH_KEY, CPTrainStep


class CPSlicedTrainStep(CPTrainStep):
    """``CPTrainStep`` whose microbatches run as SlimPipe slices following each window's plan."""

    def __init__(self, recipe: Recipe, groups, eod: int, slice_lengths: Sequence[int]) -> None:
        super().__init__(recipe, groups, eod)
        self.slice_lengths = tuple(slice_lengths)
        self.slices = SliceContext()  # the schedule's context: pass it to make_forward_backward_func
        self.shares: list[tuple[SliceShare, ...]] = []

    def attach(self, chunks) -> None:
        """Nothing to attach: the schedule points the chunks' slice attention at ``self.slices``."""

    def plan_iteration(self, microbatches: list[dict]) -> list[dict]:
        tagged = super().plan_iteration(microbatches)
        self.shares = window_shares(self.plans, self.slice_lengths)
        self.slices.cp_shares = dict(enumerate(self.shares))
        return [{**b, DOCUMENT_LENGTHS: plan.lengths} for b, (plan, _, _) in zip(tagged, self.plans)]

    def stage_rows(self, microbatch: int, slice_: int) -> int:
        """Rows of this CP rank's hidden states of one slice between pipeline stages."""
        return self.shares[microbatch][slice_].rows(self.cp_rank)

    def forward_step(self, data_iterator, model):
        from megatron_slim.megatron.cp.data import cp_loss_func

        batch = next(data_iterator)
        info = self.slices.current
        if info is None or info.microbatch != batch[MICROBATCH_KEY]:
            raise RuntimeError(
                f"cp.engine with schedule.num_slices={len(self.slice_lengths)}: a slice of microbatch "
                f"{batch[MICROBATCH_KEY]} was read outside its SlimPipe slice ({info}); allowed: the forward step "
                "of the schedule made with this step's SliceContext"
            )
        local = rows_of_share(batch, self.shares[info.microbatch][info.slice], self.cp_rank)
        output = model(local["tokens"], local["position_ids"], None, labels=local["labels"])
        return output, functools.partial(cp_loss_func, local["loss_mask"], cp_group=self.cp_group)


def sliced_under_engine(recipe: Recipe) -> bool:
    """``train`` runs SlimPipe slices of windows a CP engine planned (not packed windows)."""
    s, p = recipe.schedule, recipe.parallel
    return p.cp > 1 and not recipe.query_out_cp and s.kind == "slimpipe" and s.num_slices > 1


def engine_train_step(recipe: Recipe, groups, eod: int, slice_lengths) -> CPTrainStep:
    """The CP plumbing of an engine run: whole planned packs, or SlimPipe slices that follow each plan."""
    if sliced_under_engine(recipe):
        return CPSlicedTrainStep(recipe, groups, eod, slice_lengths)
    return CPTrainStep(recipe, groups, eod)
