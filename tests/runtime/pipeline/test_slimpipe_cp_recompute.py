"""Activation recomputation and offloading under SlimPipe's zigzag query-out context parallelism,
pp2 x cp2 over gloo on megatron-core (RoPE, RMSNorm, SwiGLU, GQA), 4 slices: the loss and every
parameter gradient equal the single-process, unpipelined, unsliced, un-CP reference
(``test_slimpipe_cp_exactness``'s check and tolerance), and bit for bit the same CP run without
recomputation or offloading (a recomputed slice's CP attention reads the K/V prefix its forward
cached, gathers its own K/V again over the CP group and appends nothing: ``check_recomputed``).
Under context exchange a recomputed forward is built without the exchange (the blocks were served
in the first forward), so the sums run in another order: there the gradients meet the reference
within round-off, not the run without recomputation bit for bit.

Not vacuous: full recomputation lowers the activation meter's peak, offloading moves bytes off it,
and under context exchange (pp2 pairs forward blocks) some K/V rows were shipped, as many with
recomputation or offloading as without."""

import pytest
import torch

from megatron_slim.plan.cost.slicing import uniform_slices
from megatron_slim.runtime.spawn import run_ranks
from tests.runtime.pipeline import _recompute_workers
from tests.runtime.pipeline.test_slimpipe_cp_exactness import SEQ, _check

PP, CP, MICROBATCHES = 2, 2, 3
LENGTHS = uniform_slices(SEQ, 4, 2 * CP)


def _full(method, layers):
    return dict(recompute_granularity="full", recompute_method=method, recompute_num_layers=layers)


SELECTIVE = dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"])
CASES = [
    ("none", {}, 0.0),
    ("full-uniform-1", _full("uniform", 1), 0.0),
    ("full-block-3", _full("block", 3), 0.0),
    ("selective-core_attn-mlp", SELECTIVE, 0.0),
    ("offload-0.5", {}, 0.5),
]
# the default tier runs one spawn with every case; the same cases with exchange run in the slow tier


def _check_cases(results, cases, bitwise=True):
    names = [name for name, _, _ in cases]
    _check([[rank_results[n][:4] for n in names] for rank_results in results], names)
    if not bitwise:
        return
    for rank_results in results:
        want_losses, want_grads = rank_results["none"][:2]
        for name in names[1:]:
            losses, grads = rank_results[name][:2]
            assert all(torch.equal(a, b) for a, b in zip(losses, want_losses)) and len(losses) == len(want_losses)
            for key, want in want_grads.items():
                assert torch.equal(grads[key], want), f"{name}: {key} differs by {(grads[key] - want).abs().max()}"


def test_recompute_and_offload_under_cp_match_the_reference():
    results = run_ranks(_recompute_workers.run_cp_cases, PP * CP, CP, CASES, LENGTHS, MICROBATCHES, timeout_s=900)
    _check_cases(results, CASES)
    for rank_results in results:
        none, full, offload = (rank_results[c] for c in ("none", "full-uniform-1", "offload-0.5"))
        assert full[4] < none[4] / 2, (full[4], none[4])
        assert offload[5] > 0 and offload[4] < none[4] and none[5] == 0


@pytest.mark.slow
def test_recompute_and_offload_under_cp_with_context_exchange_match_the_reference():
    results = run_ranks(_recompute_workers.run_cp_cases, PP * CP, CP, CASES, LENGTHS, MICROBATCHES, True, timeout_s=900)
    _check_cases(results, CASES, bitwise=False)
    assert all(r[name][6] == r["none"][6] for r in results for name, _, _ in CASES)
    assert all(r["offload-0.5"][5] > 0 for r in results)
    assert sum(r["none"][6] for r in results) > 0
