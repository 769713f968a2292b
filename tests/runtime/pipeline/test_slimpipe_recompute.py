"""Activation recomputation and offloading under SlimPipe on megatron-core (RoPE, RMSNorm, SwiGLU,
GQA) over gloo, pp=2 with 2 slices: the loss and every parameter gradient equal, bit for bit, those
of the same run without recomputation or offloading (CPU kernels are deterministic and both runs
sum in the same order: a recomputed slice reads the K/V prefix the forward cached and appends
nothing, and its dK/dV go to the same fp32 buffers). Recomputation is megatron-core's own
(``TransformerConfig.recompute_*``, ``tensor_parallel.checkpoint`` around the layers or modules).

Memory, as the activation meter measures it: full recomputation keeps only each checkpoint's input,
and offloading ratio 0.5 (2 of 4 layers; under block recomputation of 1 layer, 2 of the other 3)
moves half of what ratio 1 moves, off the meter."""

import pytest
import torch

from megatron_slim.runtime.spawn import run_ranks
from tests.runtime.pipeline import _recompute_workers

LENGTHS, MICROBATCHES = (16, 16), 2


def _full(method, layers):
    return dict(recompute_granularity="full", recompute_method=method, recompute_num_layers=layers)


CASES = [
    ("none", {}, 0.0),
    ("full-uniform-1", _full("uniform", 1), 0.0),
    ("full-uniform-2", _full("uniform", 2), 0.0),
    ("full-block-1", _full("block", 1), 0.0),
    ("full-block-3", _full("block", 3), 0.0),
    ("selective-core_attn", dict(recompute_granularity="selective", recompute_modules=["core_attn"]), 0.0),
    ("selective-core_attn-mlp", dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"]), 0.0),
    ("offload-0.5", {}, 0.5),
    ("offload-1", {}, 1.0),
    ("full-block-1-offload-0.5", _full("block", 1), 0.5),
]


@pytest.fixture(scope="module")
def results():
    """Per pipeline rank: case -> (loss reports, gradients, peak activation bytes, offloaded bytes)."""
    return run_ranks(_recompute_workers.run_cases, 2, CASES, LENGTHS, MICROBATCHES, timeout_s=600)


@pytest.mark.parametrize("case", [name for name, _, _ in CASES[1:]])
def test_gradients_and_losses_equal_the_run_without_recompute(results, case):
    for rank_results in results:
        losses, grads, _, _ = rank_results[case]
        want_losses, want_grads, _, _ = rank_results["none"]
        assert len(losses) == len(want_losses)
        for got, want in zip(losses, want_losses):
            assert torch.equal(got, want), case
        assert grads.keys() == want_grads.keys() and grads
        for name, want in want_grads.items():
            assert grads[name] is not None, name
            assert torch.equal(grads[name], want), f"{case}: {name} differs by {(grads[name] - want).abs().max()}"
    assert len(results[-1]["none"][0]) == MICROBATCHES  # the last stage reported every microbatch


def _peaks(results, case):
    return [rank_results[case][2] for rank_results in results]


def test_full_recompute_keeps_less_than_block_and_block_less_than_none(results):
    cases = ("none", "full-block-1", "full-block-3", "full-uniform-1", "full-uniform-2")
    for none, block1, block3, uniform1, uniform2 in zip(*(_peaks(results, c) for c in cases)):
        assert uniform2 < uniform1 < block3 < block1 < none
    none, uniform1 = _peaks(results, "none")[0], _peaks(results, "full-uniform-1")[0]
    assert uniform1 < none / 10  # stage 0 (no output layer): only each layer's input hidden states stay


def test_offloading_half_the_layers_moves_half_the_layer_activations_off_the_meter(results):
    for rank_results in results:
        none, half, whole = (rank_results[c][2] for c in ("none", "offload-0.5", "offload-1"))
        moved_half, moved_whole = rank_results["offload-0.5"][3], rank_results["offload-1"][3]
        assert rank_results["none"][3] == 0
        assert moved_whole == 2 * moved_half > 0  # 2 of a chunk's 4 identical layers, every slice
        assert whole < none / 10  # the decoder layers hold nearly all of a stage's saved activations
        assert none - half == pytest.approx((none - whole) / 2, rel=0.1)
        # block recomputation of layer 1: 2 of the other 3 layers (floor(1.5 + 1/2)) offload
        assert rank_results["full-block-1-offload-0.5"][3] == moved_half
