"""A megatron-core GPT (RoPE, RMSNorm, SwiGLU, GQA) with Zeppelin's CP attention engine and remap
layer on 4 gloo ranks (2 nodes x 2) equals the unsharded single-process reference -- the whole
model, plain causal attention run sequence by sequence with positions from 0 -- in the loss and in
EVERY parameter gradient (CP gradients averaged over the CP group as megatron's DDP does, with the
loss normalised as ``cp_data.cp_loss_func`` documents).

Tolerance: |a - b| <= 2e-5 + 1e-4 * |b| elementwise (fp32; CP only reorders floating-point sums:
attention merges log-sum-exp partials, dK/dV add up over ring steps, gradients over ranks).
"""

import pytest
import torch

from megatron_slim.runtime.spawn import run_ranks
from tests.oracle.models import TINY_GQA_2L_LONG
from tests.runtime.cp import _plans, _workers
from tests.runtime.cp.conftest import WORLD

TOL = dict(atol=2e-5, rtol=1e-4)
CASES = [("zeppelin-routed", True), ("zeppelin", False), ("skewed", True)]
# a CP rank without tokens runs one masked padding row (megatron-core cannot run zero tokens):
# with remap the padding row stays put while tokens move onto its rank (ones-ring), a rank may run
# its MLP on zero rows (few-zeppelin); the slow set covers every other engine
EMPTY_RANK_CASES = [("ones-ring", True), ("few-zeppelin", True), ("few-ulysses", False)]
SLOW_EMPTY_RANK_CASES = [
    ("ones-allgather", False),
    ("ones-a2a+p2p", True),
    ("few-ring", False),
    ("few-allgather", True),
    ("few-a2a+p2p", False),
    ("few-dynamic", True),
]
SLOW_CASES = [("hierarchical", True), ("ulysses", True), ("allgather", False), ("relay", True), ("dynamic", True)]


def _check(results, cases):
    for case in cases:
        got = results[0][case]
        ref_loss, ref_grads = got["reference"]
        assert got["attentions"] == TINY_GQA_2L_LONG["num_layers"]
        assert got["remap_layers"] == (TINY_GQA_2L_LONG["num_layers"] if case[1] else 0)
        torch.testing.assert_close(got["loss"], ref_loss, **TOL)
        assert got["grads"].keys() == ref_grads.keys()
        for name, want in ref_grads.items():
            assert want is not None and got["grads"][name] is not None, name
            where = f"{case} {name}"
            torch.testing.assert_close(got["grads"][name], want, **TOL, msg=lambda m, where=where: f"{where}: {m}")
        for rank in range(1, WORLD):  # every rank reports the same pack loss
            torch.testing.assert_close(results[rank][case]["loss"], got["loss"], atol=0, rtol=0)


def test_gpt_with_cp_engine_and_remap_matches_unsharded_reference():
    results = run_ranks(_workers.model_cases, WORLD, CASES, timeout_s=600)
    assert results[0][("skewed", True)]["moved"] > 0
    _check(results, CASES)


@pytest.mark.slow
def test_gpt_with_every_group_kind_matches_unsharded_reference():
    results = run_ranks(_workers.model_cases, WORLD, SLOW_CASES, timeout_s=900)
    _check(results, SLOW_CASES)


@pytest.mark.parametrize(
    "cases",
    [
        # slow tier: tests/train/test_train_cp_pipeline.py runs packs that leave a CP rank empty under
        # every engine other than zeppelin, against the per-document reference, in the default tier
        pytest.param(EMPTY_RANK_CASES, id="fast", marks=pytest.mark.slow),
        pytest.param(SLOW_EMPTY_RANK_CASES, id="every-engine", marks=pytest.mark.slow),
    ],
)
def test_gpt_runs_packs_that_leave_a_cp_rank_without_tokens(cases):
    """One-token documents only (ring, allgather and a2a+p2p put every token on one rank) and packs
    with fewer tokens than CP ranks (some rank is empty under every engine; with remap even in the
    token-balanced layout): the empty ranks take part in every collective and the result is exact."""
    for name, remap in cases:
        plan = _plans.case(name)[0]
        assert 0 in plan.tokens_per_rank(), name
        if remap and name == "ones-ring":
            assert _plans.remap_for(plan).moved_tokens > 0
    results = run_ranks(_workers.model_cases, WORLD, cases, timeout_s=600)
    _check(results, cases)
