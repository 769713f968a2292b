"""SlimPipe x context parallelism on megatron-core chunks over gloo: the loss and every parameter
gradient equal a single-process, unpipelined, unsliced, un-CP reference within fp32 round-off.

Each slice goes through megatron's own ``get_batch_on_this_cp_rank``; gradients are averaged over
the CP group as megatron's DDP does (dp = 1); loss reports are summed over the CP group as
megatron's ``train_step`` does. Loss functions: "cp" (local sum x cp over the CP group's count, the
CP-exact form, random loss masks), "stock" (pretrain_gpt's local count; exact when every rank holds
as many loss tokens: all-ones masks), "legacy" (2-tuple CP-group mean, one slice). tp2 x cp2 checks
the CP attention on tensor-parallel head shards (GQA groups split over TP); gradients are compared
shard by shard. Sequence parallelism is not covered: megatron-core's SP collectives need CUDA.

Tolerance: |a - b| <= 2e-5 + 1e-4 * |b| elementwise (fp32; CP and slicing only reorder sums:
partials merge by log-sum-exp in fp32, dQ is summed over CP ranks in fp32, dK/dV accumulate in
fp32), the same as the non-CP SlimPipe exactness test."""

import pytest
import torch

from megatron_slim.plan.cost.slicing import balanced_slices, uniform_slices
from megatron_slim.runtime.spawn import run_ranks
from tests.oracle.models import TINY_GQA_8L
from tests.runtime.pipeline import _cp_workers

SEQ = TINY_GQA_8L["seq_length"]
TOL = dict(atol=2e-5, rtol=1e-4)
ALIGN = 4  # 2 * cp


def _uniform(n):
    return uniform_slices(SEQ, n, ALIGN)


def _balanced(n):
    return balanced_slices(SEQ, n, per_token=1.0, per_pair=0.08, alignment=ALIGN)


CONFIGS_PP2_CP2 = [
    (1, 3, _uniform(1), "cp"),
    (1, 2, _uniform(2), "cp"),
    (1, 4, _uniform(4), "cp"),
    (1, 3, _balanced(2), "cp"),
    (1, 2, _balanced(4), "cp"),
    (2, 3, _uniform(4), "cp"),
    (2, 2, _balanced(4), "cp"),
    (1, 2, _uniform(2), "stock"),
    (1, 2, _uniform(1), "legacy"),
]
CONFIGS_PP1_CP2 = [
    (1, 2, _uniform(1), "cp"),
    (1, 3, _uniform(4), "cp"),
    (1, 2, _balanced(2), "cp"),
    (1, 1, _balanced(4), "stock"),
    (1, 2, _uniform(1), "legacy"),
]
CONFIGS_TP2_CP2 = [(1, 2, _balanced(2), "cp"), (1, 1, _uniform(4), "cp")]


def _check(results, configs):
    for index, config in enumerate(configs):
        refs = {r[index][2]: r[index][3] for r in results if r[index][3] is not None}  # tp rank -> reference
        merged = {}  # (tp rank, name) -> grad
        for rank_results in results:
            _, grads, tp_rank, _ = rank_results[index]
            for name, g in grads.items():
                assert g is not None, (config, name)
                if (tp_rank, name) in merged:  # CP peers hold the same parameters; DDP made their grads equal
                    torch.testing.assert_close(g, merged[(tp_rank, name)], atol=0, rtol=0)
                merged[(tp_rank, name)] = g
        ref_reports = refs[0][0]
        reports = results[-1][index][0]  # the last pipeline stage returns the losses
        assert len(reports) == len(ref_reports), config
        for got, want in zip(reports, ref_reports):
            torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{config} report: {m}")
        want_grads = {(t, n): g for t, (_, grads) in refs.items() for n, g in grads.items()}
        assert merged.keys() == want_grads.keys(), config
        for key, want in want_grads.items():
            torch.testing.assert_close(merged[key], want, **TOL, msg=lambda m: f"{config} {key}: {m}")


def test_cp_slices_are_balanced_and_aligned():
    for n in (2, 4):
        lengths = _balanced(n)
        assert len(set(lengths)) > 1 and sum(lengths) == SEQ and all(x % ALIGN == 0 for x in lengths)


# default tier: each loss function once, both slice policies, vpp 1 and 2, tp2 once; slow tier: every shape
PP2_CP2_DEFAULT = [CONFIGS_PP2_CP2[2], CONFIGS_PP2_CP2[6], CONFIGS_PP2_CP2[7], CONFIGS_PP2_CP2[8]]


@pytest.mark.parametrize(
    "world,layouts",
    [
        (4, [(1, 2, 2, PP2_CP2_DEFAULT), (2, 1, 2, CONFIGS_TP2_CP2[:1])]),  # one spawn: pp2 x cp2, then tp2 x cp2
        pytest.param(4, [(1, 2, 2, CONFIGS_PP2_CP2), (2, 1, 2, CONFIGS_TP2_CP2)], marks=pytest.mark.slow),
        # slow tier: the pp2 x cp2 spawn runs the same query-out CP attention on both stages
        pytest.param(2, [(1, 1, 2, CONFIGS_PP1_CP2)], marks=pytest.mark.slow),
    ],
    ids=["pp2xcp2+tp2xcp2", "pp2xcp2+tp2xcp2-all", "pp1xcp2"],
)
def test_slimpipe_cp_matches_single_process_reference(world, layouts):
    results = run_ranks(_cp_workers.run_slimpipe_cp, world, layouts, timeout_s=600)
    for index, (*_, configs) in enumerate(layouts):
        _check([rank_results[index] for rank_results in results], configs)
