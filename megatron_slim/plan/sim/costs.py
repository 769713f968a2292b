"""What each schedule action costs, as the simulator asks for it.

``PipelineCosts`` is the interface; ``RecipeCosts`` answers it from the cost model and a slice
plan. Anything else (a packing plan with per-microbatch lengths, a test's synthetic costs) can
implement the same methods.
"""

from __future__ import annotations

from typing import Protocol

from megatron_slim.plan.cost.exchange import ExchangeWork, exchange_work
from megatron_slim.plan.cost.model import CostModel, Link
from megatron_slim.plan.cost.slicing import balanced_slices, slice_prefixes, uniform_slices
from megatron_slim.plan.recipe import Recipe


class PipelineCosts(Protocol):
    def forward(self, stage: int, microbatch: int, slice_: int) -> float: ...
    def backward(self, stage: int, microbatch: int, slice_: int) -> float: ...
    def weight_grad(self, stage: int, microbatch: int, slice_: int) -> float: ...
    def activation_bytes(self, stage: int, microbatch: int, slice_: int) -> float: ...
    def backward_transient_bytes(self, stage: int, microbatch: int, slice_: int) -> float: ...
    def kv_bytes(self, stage: int, microbatch: int, slice_: int) -> float: ...
    def kv_grad_bytes(self, stage: int, microbatch: int, slice_: int) -> float: ...
    def p2p_bytes(self, stage: int, microbatch: int, slice_: int) -> float: ...
    def link(self, src_rank: int, dst_rank: int) -> Link: ...
    def static_bytes(self, rank: int) -> float: ...
    def after_pipeline(self, rank: int) -> float: ...
    def model_flops(self) -> float: ...
    def peak_flops(self) -> float: ...
    def hbm_bytes(self) -> float: ...


class ExchangeCosts(Protocol):
    """What the simulator also asks of costs when the schedule carries a context-exchange pairing:
    the sender's slice ``(stage, microbatch, slice_)`` moving ``moved`` K/V prefix tokens."""

    def exchange(self, stage: int, microbatch: int, slice_: int, moved: int, backward: bool) -> ExchangeWork: ...


def slice_lengths(recipe: Recipe, cost: CostModel) -> tuple[int, ...]:
    """The slice plan of a recipe: what both the simulator and the runtime cut sequences into."""
    s = recipe.schedule
    seq = recipe.model.seq_length
    if s.num_slices == 1:
        return (seq,)
    if s.slice_policy in ("uniform", "exchange"):  # exchange: uniform slices, attention work moves instead
        return uniform_slices(seq, s.num_slices, recipe.slice_alignment)
    per_token, per_pair = cost.slice_cost_coefficients(seq / s.num_slices, seq)
    return balanced_slices(seq, s.num_slices, per_token, per_pair, recipe.slice_alignment)


class CostModelTerms:
    """The ``PipelineCosts`` answers that depend on the cost model alone, not on slices or packing:
    pipeline links, static memory, what runs after the pipeline, peak rates."""

    cost: CostModel

    def link(self, src_rank: int, dst_rank: int) -> Link:
        return self.cost.pp_link(src_rank, dst_rank)

    def static_bytes(self, rank: int) -> float:
        return self.cost.static_bytes(rank)

    def after_pipeline(self, rank: int) -> float:
        return self.cost.grad_sync_time(rank) + self.cost.optimizer_time(rank)

    def peak_flops(self) -> float:
        return self.cost.hw.peak_bf16_flops

    def hbm_bytes(self) -> float:
        return self.cost.hw.usable_hbm_bytes


class RecipeCosts(CostModelTerms):
    """Every microbatch has the recipe's sequence length, cut by the recipe's slice policy."""

    def __init__(self, recipe: Recipe, cost: CostModel | None = None, lengths: tuple[int, ...] | None = None) -> None:
        self.recipe = recipe
        self.cost = cost or CostModel(recipe)
        self.lengths = lengths or slice_lengths(recipe, self.cost)
        self.prefixes = slice_prefixes(self.lengths)

    def _length_and_prefix(self, slice_: int) -> tuple[int, int]:
        return self.lengths[slice_], self.prefixes[slice_]

    def forward(self, stage: int, microbatch: int, slice_: int) -> float:
        return self.cost.forward_time(stage, *self._length_and_prefix(slice_))

    def backward(self, stage: int, microbatch: int, slice_: int) -> float:
        return self.cost.backward_time(stage, *self._length_and_prefix(slice_))

    def weight_grad(self, stage: int, microbatch: int, slice_: int) -> float:
        return self.cost.weight_grad_time(stage, *self._length_and_prefix(slice_))

    def activation_bytes(self, stage: int, microbatch: int, slice_: int) -> float:
        return self.cost.activation_bytes(stage, self.lengths[slice_])

    def backward_transient_bytes(self, stage: int, microbatch: int, slice_: int) -> float:
        return self.cost.backward_transient_bytes(stage, self.lengths[slice_])

    def kv_bytes(self, stage: int, microbatch: int, slice_: int) -> float:
        return self.cost.kv_bytes(stage, self.lengths[slice_])

    def kv_grad_bytes(self, stage: int, microbatch: int, slice_: int) -> float:
        return self.cost.kv_grad_bytes(stage, self.lengths[slice_])

    def p2p_bytes(self, stage: int, microbatch: int, slice_: int) -> float:
        return self.cost.p2p_bytes(self.lengths[slice_])

    def exchange(self, stage: int, microbatch: int, slice_: int, moved: int, backward: bool) -> ExchangeWork:
        return exchange_work(self.cost, self.lengths[slice_], moved, backward)

    def model_flops(self) -> float:
        return self.recipe.num_microbatches * self.cost.model_flops(self.recipe.model.seq_length)
