"""Context exchange under query-out context parallelism (zigzag shards, cp2) on megatron-core
(RoPE, RMSNorm, SwiGLU, GQA) over gloo: the loss and every parameter gradient equal the
single-process, unpipelined, unsliced, un-CP reference (``test_slimpipe_cp_exactness``'s check and
tolerance). Each CP rank of a sender stage ships its own shards (its query rows, its shard of the
moved K/V) to the CP rank of the same index on the peer stage, whose CP ranks run the moved block
query-out (``runtime/pipeline/cp_exchange.py``, ``exchange_cp_server.py``). Block plans beyond
pairs: ``test_exchange_blocks_cp_exactness.py``.

Not vacuous: every rank's shipped K/V rows equal the pairing's moved tokens / cp x layers per
chunk over its stage's sender ends, and some are positive; the vpp2 config has a pair across
model chunks; pp2 pairs forwards only, so pp4 x cp2 (8 ranks) checks backward pairs."""

import pytest

from megatron_slim.plan.schedule.exchange_blocks import ExchangePlan
from megatron_slim.runtime.spawn import run_ranks
from tests.oracle.models import TINY_GQA_8L
from tests.runtime.pipeline import _cp_workers
from tests.runtime.pipeline.test_slimpipe_cp_exactness import _check, _uniform

CP = 2
CONFIGS = {
    2: [(1, 3, _uniform(4), "cp"), (1, 4, _uniform(8), "cp"), (2, 4, _uniform(4), "cp")],
    4: [(1, 4, _uniform(4), "cp")],
}


def _check_moved(results, pp, configs):
    for index, (vpp, *_) in enumerate(configs):
        pairing = results[0][index][5]
        assert all(r[index][5] == pairing for r in results), "ranks planned different pairs"
        plan = ExchangePlan.from_text(pairing)
        layers = TINY_GQA_8L["num_layers"] // (pp * vpp)
        sent = [r[index][4] for r in results]
        # megatron's rank order is tp-cp-dp-pp: global rank = pp rank * cp + cp rank (tp = dp = 1)
        shipped = [sum(p.tokens // CP * layers for p in plan.blocks if p.sender == stage) for stage in range(pp)]
        expected = [shipped[rank // CP] for rank in range(pp * CP)]
        assert sent == expected and sum(sent) > 0, (sent, expected)
        if vpp > 1:
            assert any(p.sender_action.chunk != p.taker_action.chunk for p in plan.blocks)
        if pp == 4:
            assert any(p.sender_action.kind.is_backward for p in plan.blocks), "no backward pair exercised"


# pp2 x cp2 moves forward blocks only; pp4 x cp2 (default tier) moves forward and backward ones.
# Both in the slow tier: tests/train/test_train_exchange_cp.py runs this path (forward and backward
# pairs under zigzag query-out CP) at pp2xcp2 in the default tier.
@pytest.mark.parametrize(
    "pp", [pytest.param(2, marks=pytest.mark.slow, id="pp2xcp2"), pytest.param(4, marks=pytest.mark.slow, id="pp4xcp2")]
)
def test_exchange_under_cp_matches_single_process_reference(pp):
    layouts = [(1, pp, CP, CONFIGS[pp])]
    results = run_ranks(_cp_workers.run_slimpipe_cp, pp * CP, layouts, 1234, True, timeout_s=900)
    results = [rank_results[0] for rank_results in results]  # the one layout
    _check([[r[:4] for r in rank_results] for rank_results in results], CONFIGS[pp])
    _check_moved(results, pp, CONFIGS[pp])
