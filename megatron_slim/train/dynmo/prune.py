"""Gradual magnitude pruning of whole FFN neurons (``dynmo.prune``, schedule in ``plan.dynmo.prune``).

Structure: neuron ``j`` of a SwiGLU MLP is row ``j`` of the gate and row ``j`` of the up projection
(rows ``j`` and ``ffn + j`` of ``linear_fc1.weight``) and column ``j`` of ``linear_fc2.weight``. Its
magnitude is the L2 norm of those three vectors together. When the schedule asks for more pruned
neurons, each layer prunes its smallest still-kept ones (ties: lower index first): their weights
and their AdamW moments are set to zero. Pruned neurons stay pruned.

Compute shrinks: the MLP runs on the kept neurons only, its weights gathered with ``index_select``
(so the profiler times the smaller matmuls). The gather's backward writes exact zeros into the
pruned entries' gradients, and with zero moments AdamW's update of a zero weight is exactly zero
(weight decay included), so pruned weights stay exactly zero through every step.

The mask is not stored: a pruned neuron is one whose three vectors are all zero, so the kept set is
re-derived from the weights (after a resume or a live migration, nothing else needs to travel).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from megatron_slim.megatron.model.gpt import decoder_layers
from megatron_slim.plan.dynmo.prune import PruneSchedule


def _weights(mlp) -> tuple[torch.Tensor, torch.Tensor, int]:
    w1, w2 = mlp.linear_fc1.weight, mlp.linear_fc2.weight
    return w1, w2, w2.shape[1]


def neuron_magnitudes(mlp) -> torch.Tensor:
    """``[ffn]``: the squared L2 norm of each neuron's gate row, up row and down column."""
    w1, w2, ffn = _weights(mlp)
    with torch.no_grad():
        rows = w1.float().pow(2).sum(1)
        return rows[:ffn] + rows[ffn:] + w2.float().pow(2).sum(0)


def kept_neurons(mlp) -> torch.Tensor:
    """Indices (ascending) of the neurons with any nonzero weight."""
    return (neuron_magnitudes(mlp) > 0).nonzero().squeeze(1)


def neuron_entries(w1: torch.Tensor, w2: torch.Tensor, neurons: torch.Tensor):
    """``(rows of w1, columns of w2)`` that hold ``neurons``."""
    ffn = w2.shape[1]
    return torch.cat([neurons, neurons + ffn]), neurons


def prune_to(mlp, count: int, optimizer=None) -> torch.Tensor:
    """Prune ``mlp`` until ``count`` neurons are pruned (never un-prunes); returns the kept indices."""
    w1, w2, ffn = _weights(mlp)
    kept = kept_neurons(mlp)
    extra = count - (ffn - len(kept))
    if extra > 0:
        scores = neuron_magnitudes(mlp)[kept]
        order = torch.sort(scores, stable=True).indices  # kept is ascending: ties go to the lower index
        gone = kept[order[:extra]].sort().values
        rows, cols = neuron_entries(w1, w2, gone)
        state = optimizer.state if optimizer is not None else {}
        with torch.no_grad():
            for tensor in [w1, *(state.get(w1, {}).get(k) for k in ("exp_avg", "exp_avg_sq"))]:
                if tensor is not None:
                    tensor.index_fill_(0, rows, 0.0)
            for tensor in [w2, *(state.get(w2, {}).get(k) for k in ("exp_avg", "exp_avg_sq"))]:
                if tensor is not None:
                    tensor.index_fill_(1, cols, 0.0)
        kept = kept_neurons(mlp)
    mlp.slim_kept_neurons = kept
    return kept


def _compact_forward(mlp, stock_forward, hidden_states, *args, **kwargs):
    kept = getattr(mlp, "slim_kept_neurons", None)
    w1, w2, ffn = _weights(mlp)
    if kept is None or len(kept) == ffn:
        return stock_forward(hidden_states, *args, **kwargs)
    rows, cols = neuron_entries(w1, w2, kept)
    gate, up = F.linear(hidden_states, w1.index_select(0, rows)).chunk(2, dim=-1)
    out = F.linear(mlp.config.activation_func(gate) * up, w2.index_select(1, cols))
    return out, None


def attach_pruning(chunks) -> list:
    """Give every decoder layer's MLP of ``chunks`` the compact forward; returns the MLPs."""
    mlps = []
    for layer in decoder_layers(chunks):
        mlp = layer.mlp
        if not mlp.config.gated_linear_unit or mlp.linear_fc1.bias is not None:
            raise ValueError("dynmo.prune: allowed MLPs are bias-free gated (SwiGLU) ones")
        if not hasattr(mlp, "slim_stock_forward"):
            mlp.slim_stock_forward = mlp.forward
            mlp.forward = functools.partial(_compact_forward, mlp, mlp.slim_stock_forward)
        mlps.append((layer.layer_number - 1, mlp))
    return mlps


class Pruning:
    """The schedule on this rank's layers: ``before(iteration)`` prunes to the iteration's sparsity."""

    def __init__(self, schedule: PruneSchedule, chunks, optimizer) -> None:
        self.schedule, self.optimizer = schedule, optimizer
        self.mlps = attach_pruning(chunks)

    def before(self, iteration: int) -> None:
        for _, mlp in self.mlps:
            ffn = _weights(mlp)[2]
            prune_to(mlp, self.schedule.pruned_neurons(iteration, ffn), self.optimizer)

    def kept_share(self) -> dict[int, float]:
        """Per global layer index: the share of its FFN neurons still computed."""
        return {index: len(mlp.slim_kept_neurons) / _weights(mlp)[2] for index, mlp in self.mlps}
