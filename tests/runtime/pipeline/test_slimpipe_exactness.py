"""SlimPipe on megatron-core (RoPE, RMSNorm, SwiGLU, GQA) over gloo: the loss and every parameter
gradient equal a single-process, unpipelined, unsliced reference within fp32 round-off.

Tolerance: |a - b| <= 2e-5 + 1e-4 * |b| elementwise (fp32; slicing and pipelining only reorder
floating-point sums: attention is merged by log-sum-exp over K/V chunks, dK/dV accumulate in fp32).
Each rank's peak K/V cache bytes (the cache's byte ledger) equal the simulator's to the byte."""

import pytest
import torch

from megatron_slim.plan.cost.slicing import balanced_slices, uniform_slices
from megatron_slim.plan.recipe import recipe_from_dict
from megatron_slim.plan.schedule import generate
from megatron_slim.plan.sim.costs import RecipeCosts
from megatron_slim.plan.sim.engine import simulate
from megatron_slim.runtime.spawn import run_ranks
from tests.oracle.models import TINY_GQA_8L
from tests.runtime.pipeline import _workers

SEQ = TINY_GQA_8L["seq_length"]
TOL = dict(atol=2e-5, rtol=1e-4)


def _check(results):
    for cfg_index, (_, _, ref, _) in enumerate(results[0]):  # pipeline rank 0 holds the reference
        ref_reports, ref_grads = ref
        merged = {}
        for rank_results in results:
            reports, grads, _, _ = rank_results[cfg_index]
            for name, g in grads.items():
                assert name not in merged, f"{name} on two ranks"
                merged[name] = g
        reports = results[-1][cfg_index][0]  # last stage returns the losses
        assert len(reports) == len(ref_reports)
        for got, want in zip(reports, ref_reports):
            torch.testing.assert_close(got, want, **TOL)
        assert merged.keys() == ref_grads.keys()
        for name, want in ref_grads.items():
            assert merged[name] is not None, name
            torch.testing.assert_close(merged[name], want, **TOL, msg=lambda m: f"{name}: {m}")


def _simulated_kv_peaks(pp, vpp, m, lengths):
    recipe = recipe_from_dict(
        {
            "hardware": "cpu",
            "model": TINY_GQA_8L,
            "parallel": {"pp": pp, "vpp": vpp},
            "schedule": {"kind": "slimpipe", "num_slices": len(lengths)},
            "train": {"global_batch_size": 2 * m, "micro_batch_size": 2, "precision": "fp32"},
        }
    )
    result = simulate(generate("slimpipe", pp, vpp, m, len(lengths)), RecipeCosts(recipe, lengths=tuple(lengths)))
    return [r.peak_kv_bytes for r in result.ranks]


def _check_kv_memory(results, pp, configs):
    for cfg_index, (vpp, m, lengths) in enumerate(configs):
        measured = [rank_results[cfg_index][3][1] for rank_results in results]
        assert measured == _simulated_kv_peaks(pp, vpp, m, lengths), (vpp, m, lengths)


def _balanced(n):
    return balanced_slices(SEQ, n, per_token=1.0, per_pair=0.08)


CONFIGS_PP2 = [
    (1, 3, uniform_slices(SEQ, 1)),
    (1, 2, uniform_slices(SEQ, 2)),
    (1, 5, uniform_slices(SEQ, 4)),
    (1, 4, uniform_slices(SEQ, 8)),
    (1, 3, _balanced(4)),
    (1, 2, _balanced(8)),
    (2, 3, uniform_slices(SEQ, 4)),
    (2, 2, _balanced(2)),
]
CONFIGS_PP4 = [
    (1, 4, uniform_slices(SEQ, 1)),
    (1, 3, uniform_slices(SEQ, 2)),
    (1, 5, uniform_slices(SEQ, 4)),
    (1, 2, uniform_slices(SEQ, 8)),
    (1, 4, _balanced(4)),
    (1, 3, _balanced(8)),
    (2, 4, uniform_slices(SEQ, 8)),
]


def test_balanced_lengths_are_uneven():
    assert len(set(_balanced(4))) > 1 and sum(_balanced(8)) == SEQ


# The default tier runs pp2 with one slice count per policy, one slice (no K/V cache) and vpp2 (whose
# middle stages receive and send, as pp4's do); the slow tier runs every shape at pp2 and pp4.
PP2_DEFAULT = [CONFIGS_PP2[0], CONFIGS_PP2[2], CONFIGS_PP2[5], CONFIGS_PP2[7]]


@pytest.mark.parametrize(
    "pp,configs",
    [
        (2, PP2_DEFAULT),
        pytest.param(2, CONFIGS_PP2, marks=pytest.mark.slow),
        pytest.param(4, CONFIGS_PP4, marks=pytest.mark.slow),
    ],
    ids=["pp2", "pp2-all", "pp4-all"],
)
def test_slimpipe_matches_unpipelined_unsliced_reference(pp, configs):
    results = run_ranks(_workers.run_slimpipe, pp, configs, timeout_s=900)
    _check(results)
    _check_kv_memory(results, pp, configs)
