"""Context-exchange *blocks* beyond mirrored pairs (cp = 1), over gloo on megatron-core (RoPE,
RMSNorm, SwiGLU, GQA): a hand-built plan on the lowered pp4 SlimPipe schedule (``_block_plans``)
with a sender split over two takers at a boundary inside a cached slice, a taker serving two
senders, and blocks served in the other pass both ways. The loss and every parameter gradient
equal the single-process, unpipelined, unsliced reference within the tolerance of the pair tests.

Not vacuous: the plan passes ``validate`` and has each of those shapes (checked here, without
torch), and each rank's counters equal the plan's own sums: K/V tokens sent (block tokens x
attention layers per stage) and blocks served (one per layer)."""

from collections import Counter

from megatron_slim.plan.cost.slicing import uniform_slices
from megatron_slim.plan.schedule.exchange_blocks import ExchangePlan
from megatron_slim.plan.schedule.executable import executable
from megatron_slim.plan.schedule.validate import check_link_order, validate
from megatron_slim.runtime.spawn import run_ranks
from tests.oracle.models import TINY_GQA_8L
from tests.runtime.pipeline import _exchange_workers
from tests.runtime.pipeline._block_plans import with_blocks
from tests.runtime.pipeline.test_slimpipe_exactness import SEQ, _check

PP, MICROBATCHES, LENGTHS = 4, 2, uniform_slices(SEQ, 4)
LAYERS = TINY_GQA_8L["num_layers"] // PP  # attention layers of one stage


def _plan() -> ExchangePlan:
    schedule = with_blocks(executable("slimpipe", PP, 1, MICROBATCHES, len(LENGTHS)), LENGTHS[0])
    check_link_order(validate(schedule))  # the group rendezvous the runtime relies on is satisfiable
    return ExchangePlan.from_text(schedule.exchange)


def test_the_plan_has_every_shape_beyond_pairs():
    plan, length = _plan(), LENGTHS[0]
    split = [end for end, blocks in plan.sent.items() if len({b.taker for b in blocks}) == 2]
    assert len(split) == 2 and {end[1].kind.is_backward for end in split} == {False, True}
    assert any(b.kv_end % length for blocks in plan.sent.values() for b in blocks if b.kv_start == 0)
    assert any(b.kv_start % length for b in plan.blocks), "no block boundary inside a cached slice"
    assert any(len({b.sender for b in blocks}) == 2 for blocks in plan.served.values()), "no taker of two senders"
    passes = {(b.backward, b.taker_action.kind.is_backward) for b in plan.blocks}
    assert {(True, False), (False, True)} <= passes, "cross-pass blocks both ways"


def test_blocks_match_unpipelined_unsliced_reference():
    plan = _plan()
    results = run_ranks(_exchange_workers.run_blocks, PP, [(MICROBATCHES, LENGTHS, plan.to_text())], timeout_s=900)
    _check([[(*c[:3], None) for c in rank_results] for rank_results in results])
    sent = [r[0][3] for r in results]
    served = [r[0][4] for r in results]
    expected_sent = [sum(b.tokens * LAYERS for b in plan.blocks if b.sender == rank) for rank in range(PP)]
    takers = Counter(b.taker for b in plan.blocks)
    assert sent == expected_sent and served == [takers[rank] * LAYERS for rank in range(PP)], (sent, served)
