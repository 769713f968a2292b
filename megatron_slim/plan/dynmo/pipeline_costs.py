"""A recipe's pipeline costs with decoder layers split unevenly and scaled by a dynamic scheme.

``RecipeCosts`` prices a stage as ``layers_per_stage`` identical decoder layers plus its fixed
terms; ``PartitionedCosts`` keeps the fixed terms and replaces the layer part by the sum of the
stage's own layers, each scaled by its ``LayerLoad``. The simulator times it like any other
``PipelineCosts``. One chunk per rank (vpp=1); no recomputation or offloading (the per-layer
terms here are those of layers that keep their activations; ``check_dynamic_recipe`` says so).
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_slim.plan.cost.model import Link
from megatron_slim.plan.dynmo.partition import Partition
from megatron_slim.plan.dynmo.schemes import LayerLoad
from megatron_slim.plan.recipe import Recipe
from megatron_slim.plan.schema import ConfigError
from megatron_slim.plan.sim.costs import RecipeCosts


def check_dynamic_recipe(recipe: Recipe) -> None:
    p, t = recipe.parallel, recipe.train
    if p.pp < 2:
        raise ConfigError(f"--dynamic: parallel.pp={p.pp}; allowed: pp >= 2 (rebalancing moves layers between stages)")
    if p.vpp != 1:
        raise ConfigError(f"--dynamic: parallel.vpp={p.vpp}; allowed: 1 (one contiguous block of layers per rank)")
    if t.recompute != "none" or t.offload_ratio:
        raise ConfigError(
            f"--dynamic: train.recompute={t.recompute!r}, train.offload_ratio={t.offload_ratio}; "
            "allowed: none and 0 (the per-layer model has no recompute or offload terms)"
        )


class PartitionedCosts:
    def __init__(self, base: RecipeCosts, partition: Partition, loads: Sequence[LayerLoad]) -> None:
        cost = base.cost
        if partition.num_stages != cost.num_stages or partition.num_layers != len(loads):
            raise ConfigError(
                f"PartitionedCosts: split {partition.layers_per_stage} of {len(loads)} layer loads "
                f"over {cost.num_stages} stages"
            )
        self.base, self.cost, self.partition = base, cost, partition
        self.nominal = cost.layers_per_stage
        bounds = partition.bounds()
        self.fwd = [sum(w.forward for w in loads[a:b]) for a, b in bounds]
        self.bwd = [sum(w.backward for w in loads[a:b]) for a, b in bounds]
        self.act = [sum(w.activations for w in loads[a:b]) for a, b in bounds]
        self.layer_static = cost.static_bytes(0) / cost.rank_params(0) * cost.shape.layer_params()

    def _layer(self, slice_: int, backward: bool) -> float:
        return self.cost.decoder_layer_time(self.base.lengths[slice_], self.base.prefixes[slice_], backward)

    def forward(self, stage: int, microbatch: int, slice_: int) -> float:
        extra = self._layer(slice_, False) * (self.fwd[stage] - self.nominal)
        return self.base.forward(stage, microbatch, slice_) + extra

    def backward(self, stage: int, microbatch: int, slice_: int) -> float:
        extra = self._layer(slice_, True) * (self.bwd[stage] - self.nominal)
        return self.base.backward(stage, microbatch, slice_) + extra

    def weight_grad(self, stage: int, microbatch: int, slice_: int) -> float:
        return self.base.weight_grad(stage, microbatch, slice_) * self.bwd[stage] / self.nominal

    def activation_bytes(self, stage: int, microbatch: int, slice_: int) -> float:
        per_layer = self.cost.chunk.resident_bytes(self.base.lengths[slice_]) / self.nominal
        return self.base.activation_bytes(stage, microbatch, slice_) + per_layer * (self.act[stage] - self.nominal)

    def backward_transient_bytes(self, stage: int, microbatch: int, slice_: int) -> float:
        return self.base.backward_transient_bytes(stage, microbatch, slice_)

    def kv_bytes(self, stage: int, microbatch: int, slice_: int) -> float:
        return self.base.kv_bytes(stage, microbatch, slice_) * self.act[stage] / self.nominal

    def kv_grad_bytes(self, stage: int, microbatch: int, slice_: int) -> float:
        return self.base.kv_grad_bytes(stage, microbatch, slice_) * self.act[stage] / self.nominal

    def p2p_bytes(self, stage: int, microbatch: int, slice_: int) -> float:
        return self.base.p2p_bytes(stage, microbatch, slice_)

    def link(self, src_rank: int, dst_rank: int) -> Link:
        return self.base.link(src_rank, dst_rank)

    def static_bytes(self, rank: int) -> float:
        moved = self.partition.layers_per_stage[rank] - self.nominal
        return self.base.static_bytes(rank) + self.layer_static * moved

    def after_pipeline(self, rank: int) -> float:
        return self.base.after_pipeline(rank)

    def model_flops(self) -> float:
        return self.base.model_flops()

    def peak_flops(self) -> float:
        return self.base.peak_flops()

    def hbm_bytes(self) -> float:
        return self.base.hbm_bytes()
