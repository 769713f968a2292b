"""Context exchange (``schedule.slice_policy: exchange``) on megatron-core (RoPE, RMSNorm, SwiGLU,
GQA) over gloo: with the schedule's pairs run, the loss and every parameter gradient equal the
single-process, unpipelined, unsliced reference within fp32 round-off (the tolerance of
``test_slimpipe_exactness.py``: moving a K/V block to the peer only splits the attention's
log-sum-exp into one more partial).

Not vacuous: every rank reports the K/V tokens it shipped to peers, which must equal the pairing's
own sum (moved tokens x layers per stage over the rank's sender ends) and be positive; pp4 has
backward pairs as well as forward ones. One pp4 config runs the pairing timed with a recipe's cost
model (``SlimPipeSettings.exchange_recipe``, as ``megatron-slim train`` sets it) and checks it is the
one ``plan.sim.exchange_timing`` gives ``megatron-slim simulate``."""

import pytest

from megatron_slim.plan.cost.slicing import uniform_slices
from megatron_slim.plan.recipe import load_recipe
from megatron_slim.plan.schedule.exchange_pairs import ExchangePlan
from megatron_slim.plan.sim.exchange_timing import timed_exchange_schedule
from megatron_slim.runtime.spawn import run_ranks
from tests.oracle.models import TINY_GQA_8L
from tests.runtime.pipeline import _exchange_workers
from tests.runtime.pipeline.test_slimpipe_exactness import SEQ, _check

# the third pp4 config runs the pairing timed with tiny-cpu's cost model, as megatron-slim train does
TIMED = ["schedule.slice_policy=exchange"]
CONFIGS = {
    2: [(3, uniform_slices(SEQ, 4), None), (4, uniform_slices(SEQ, 8), None)],
    4: [(4, uniform_slices(SEQ, 4), None), (3, uniform_slices(SEQ, 8), None), (4, uniform_slices(SEQ, 4), TIMED)],
}


def _check_moved(results, pp):
    layers = TINY_GQA_8L["num_layers"] // pp
    for cfg_index in range(len(CONFIGS[pp])):
        plan = ExchangePlan.from_text(results[0][cfg_index][4])
        assert all(r[cfg_index][4] == results[0][cfg_index][4] for r in results), "ranks planned different pairs"
        sent = [r[cfg_index][3] for r in results]
        expected = [sum(p.moved_tokens * layers for p in plan.pairs if p.sender == rank) for rank in range(pp)]
        assert sent == expected and sum(sent) > 0, (sent, expected)
        if pp == 4:
            assert any(p.sender_action.kind.is_backward for p in plan.pairs), "no backward pair exercised"
        m, lengths, timing = CONFIGS[pp][cfg_index]
        if timing is not None:  # what ran is the pairing megatron-slim simulate prices
            timed = timed_exchange_schedule(load_recipe("tiny-cpu", timing), m, tuple(lengths))
            assert results[0][cfg_index][4] == timed.exchange


@pytest.mark.parametrize("pp", [2, 4], ids=["pp2", "pp4"])
def test_exchange_matches_unpipelined_unsliced_reference(pp):
    results = run_ranks(_exchange_workers.run_exchange, pp, CONFIGS[pp], timeout_s=900)
    _check([[(*c[:3], None) for c in rank_results] for rank_results in results])
    _check_moved(results, pp)
