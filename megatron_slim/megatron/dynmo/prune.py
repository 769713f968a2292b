"""Gradual magnitude pruning (``--dynmo-prune``) inside Megatron-LM's loop.

The neurons to prune, the compact MLP forward and the rule that pruned neurons stay pruned are
``train.dynmo.prune``'s. What differs under Megatron is where the weights live: the optimizer steps
*main* parameters (fp32 copies, or under ``--use-distributed-optimizer`` a per-rank shard that is a
range of the flattened parameter) and keeps Adam's moments on them, and after each step it copies
the main parameters back onto the model's. So a neuron is pruned in the model's weights and, through
``MainParams.masked``, in every main parameter (each rank zeroes the part of the neuron its shard
holds) and in its moments. From then on the compact forward gives the pruned entries exact zero
gradients, DDP reduces zeros, and AdamW's update of a zero weight with zero moments is zero (weight
decay included): the pruned weights stay exactly zero. Every data-parallel rank picks the same
neurons: it ranks the same (all-gathered) model weights.

Logged every ``--log-interval`` after the step, from the weights as they are then (a pruned neuron
that any update moved away from zero would count as kept):
``dynmo pruning at iteration N (rank R): layer L keeps K of F FFN neurons``.
"""

from __future__ import annotations

import torch

from megatron_slim.megatron.dynmo.main_params import MainParams
from megatron_slim.plan.dynmo.prune import PruneSchedule


class LaunchPruning:
    def __init__(self, schedule: PruneSchedule, chunks, main_params: MainParams) -> None:
        from megatron_slim.train.dynmo.prune import attach_pruning

        self.schedule, self.main_params = schedule, main_params
        self.mlps = attach_pruning(chunks)

    def before(self, iteration: int) -> None:
        from megatron_slim.train.dynmo.prune import kept_neurons, neuron_entries, prune_to

        for _, mlp in self.mlps:
            w1, w2 = mlp.linear_fc1.weight, mlp.linear_fc2.weight
            before = kept_neurons(mlp)
            kept = prune_to(mlp, self.schedule.pruned_neurons(iteration, w2.shape[1]))
            gone = before[~torch.isin(before, kept)]
            if len(gone):
                rows, cols = neuron_entries(w1, w2, gone)
                self._zero_mains(w1, torch.zeros_like(w1, dtype=torch.bool).index_fill_(0, rows, True))
                self._zero_mains(w2, torch.zeros_like(w2, dtype=torch.bool).index_fill_(1, cols, True))

    def _zero_mains(self, model_param: torch.Tensor, mask: torch.Tensor) -> None:
        with torch.no_grad():
            for part, tensors in self.main_params.masked(model_param, mask):
                for tensor in tensors:
                    tensor.masked_fill_(part, 0.0)

    def lines(self, iteration: int, rank: int) -> list[str]:
        from megatron_slim.train.dynmo.prune import kept_neurons

        return [
            f"dynmo pruning at iteration {iteration} (rank {rank}): layer {index} keeps {len(kept_neurons(mlp))} "
            f"of {mlp.linear_fc2.weight.shape[1]} FFN neurons"
            for index, mlp in self.mlps
        ]
