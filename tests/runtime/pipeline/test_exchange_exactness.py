"""Context exchange (``schedule.slice_policy: exchange``) on megatron-core (RoPE, RMSNorm, SwiGLU,
GQA) over gloo: with the schedule's pairs run, the loss and every parameter gradient equal the
single-process, unpipelined, unsliced reference within fp32 round-off (the tolerance of
``test_slimpipe_exactness.py``: moving a K/V block to the peer only splits the attention's
log-sum-exp into one more partial).

Not vacuous: every rank reports the K/V tokens it shipped to peers, which must equal the pairing's
own sum (moved tokens x layers per model chunk over the rank's sender ends) and be positive; pp4 has
backward pairs as well as forward ones. One pp4 config runs the pairing timed with a recipe's cost
model (``SlimPipeSettings.exchange_recipe``, as ``megatron-slim train`` sets it) and checks it is the
one ``plan.sim.exchange_timing`` gives ``megatron-slim simulate``; so does one interleaved (vpp2)
config. Interleaved pairs couple actions of different model chunks (the peer attends the sender's
Q/K/V of the sender's layer; attention has no weights), so the vpp cases check such a pair ran, and
at pp4 that both chunks send and serve, forward and backward."""

import pytest

from megatron_slim.plan.cost.slicing import uniform_slices
from megatron_slim.plan.recipe import load_recipe
from megatron_slim.plan.schedule.exchange_blocks import ExchangePlan
from megatron_slim.plan.sim.exchange_timing import timed_exchange_schedule
from megatron_slim.runtime.spawn import run_ranks
from tests.oracle.models import TINY_GQA_8L
from tests.runtime.pipeline import _exchange_workers
from tests.runtime.pipeline.test_slimpipe_exactness import SEQ, _check

# timed configs run the pairing timed with tiny-cpu's cost model, as megatron-slim train does
TIMED = ["schedule.slice_policy=exchange"]
TIMED_PP2_VPP2 = ["parallel.pp=2", "parallel.vpp=2", *TIMED]
# (vpp, microbatches, slice lengths, timing overrides or None for the unit-time pairing)
PP2 = [(1, 3, uniform_slices(SEQ, 4), None), (1, 4, uniform_slices(SEQ, 8), None)]
PP4 = [
    (1, 4, uniform_slices(SEQ, 4), None),
    (1, 3, uniform_slices(SEQ, 8), None),
    (1, 4, uniform_slices(SEQ, 4), TIMED),
]
PP2_VPP2 = [(2, 4, uniform_slices(SEQ, 4), None), (2, 3, uniform_slices(SEQ, 4), TIMED_PP2_VPP2)]
PP4_VPP2 = [(2, 4, uniform_slices(SEQ, 4), None)]


def _check_pairs(plan: ExchangePlan, pp: int, vpp: int) -> None:
    if pp == 4:
        assert any(p.sender_action.kind.is_backward for p in plan.blocks), "no backward pair exercised"
    if vpp > 1:
        assert any(p.sender_action.chunk != p.taker_action.chunk for p in plan.blocks), "no cross-chunk pair"
    if vpp > 1 and pp == 4:
        for end in ("sender_action", "taker_action"):
            assert {getattr(p, end).chunk for p in plan.blocks} == set(range(vpp)), end


def _check_moved(results, pp, configs):
    for cfg_index, (vpp, m, lengths, timing) in enumerate(configs):
        layers = TINY_GQA_8L["num_layers"] // (pp * vpp)  # attention layers of one model chunk
        plan = ExchangePlan.from_text(results[0][cfg_index][4])
        assert all(r[cfg_index][4] == results[0][cfg_index][4] for r in results), "ranks planned different pairs"
        sent = [r[cfg_index][3] for r in results]
        expected = [sum(p.tokens * layers for p in plan.blocks if p.sender == rank) for rank in range(pp)]
        assert sent == expected and sum(sent) > 0, (sent, expected)
        _check_pairs(plan, pp, vpp)
        if timing is not None:  # what ran is the pairing megatron-slim simulate prices
            timed = timed_exchange_schedule(load_recipe("tiny-cpu", timing), m, tuple(lengths))
            assert results[0][cfg_index][4] == timed.exchange


# default tier: pp2; two model chunks with exchange run in the default tier through train
# (tests/train/test_train_exchange_cp.py::...[pp2xvpp2-recompute-full]); the slow tier runs every shape
SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "pp,configs",
    [
        (2, PP2),
        pytest.param(4, PP4, marks=SLOW),
        pytest.param(2, PP2_VPP2, marks=SLOW),
        pytest.param(4, PP4_VPP2, marks=SLOW),
    ],
    ids=["pp2", "pp4", "pp2-vpp2", "pp4-vpp2"],
)
def test_exchange_matches_unpipelined_unsliced_reference(pp, configs):
    results = run_ranks(_exchange_workers.run_exchange, pp, configs, timeout_s=900)
    _check([[(*c[:3], None) for c in rank_results] for rank_results in results])
    _check_moved(results, pp, configs)
