"""Context-exchange *block plans* under query-out context parallelism (zigzag shards), pp4 x cp2 over
gloo on megatron-core (RoPE, RMSNorm, SwiGLU, GQA): the hand-built plan of
``test_exchange_blocks_exactness`` (``_block_plans``: a sender split over two takers, a taker serving
two senders, cross-pass blocks both ways), with block boundaries at odd token positions, so inside a
cached slice *and* inside a zigzag chunk (2 tokens at cp2): each CP rank ships its own rows of each
range (``runtime/pipeline/cp_exchange.py``) and the taker stage's CP ranks serve in plan order
(``exchange_cp_server.py``). The loss and every parameter gradient equal the single-process,
unpipelined, unsliced, un-CP reference (``test_slimpipe_cp_exactness``'s check and tolerance).

Not vacuous: the plan has those shapes (checked without torch), and each rank's counters equal an
independent count: K/V rows sent = the block's tokens whose zigzag chunk the rank holds x attention
layers; blocks served = the stage's served blocks x layers."""

from collections import Counter

from megatron_slim.plan.cost.slicing import uniform_slices
from megatron_slim.plan.schedule.exchange_blocks import ExchangePlan
from megatron_slim.plan.schedule.executable import executable
from megatron_slim.plan.schedule.validate import check_link_order, validate
from megatron_slim.runtime.spawn import run_ranks
from tests.oracle.models import TINY_GQA_8L
from tests.runtime.pipeline import _cp_block_workers
from tests.runtime.pipeline._block_plans import with_blocks
from tests.runtime.pipeline.test_slimpipe_cp_exactness import SEQ, _check

PP, CP, MICROBATCHES = 4, 2, 2
LENGTHS = uniform_slices(SEQ, 4)
LENGTH = LENGTHS[0]
CHUNK = LENGTH // (2 * CP)  # tokens of one zigzag chunk
LAYERS = TINY_GQA_8L["num_layers"] // PP


def _plan() -> ExchangePlan:
    schedule = with_blocks(executable("slimpipe", PP, 1, MICROBATCHES, len(LENGTHS)), LENGTH, LENGTH // 2 + 1, 1)
    check_link_order(validate(schedule))
    return ExchangePlan.from_text(schedule.exchange)


def _rows(cp_rank: int, start: int, end: int) -> int:
    """Tokens of [start, end) in the zigzag chunks ``cp_rank`` holds (chunks r and 2cp-1-r of each slice)."""
    return sum((t % LENGTH) // CHUNK in (cp_rank, 2 * CP - 1 - cp_rank) for t in range(start, end))


def test_the_plan_cuts_inside_slices_and_zigzag_chunks():
    plan = _plan()
    assert any(len({b.taker for b in blocks}) == 2 for blocks in plan.sent.values()), "no split sender"
    assert any(len({b.sender for b in blocks}) == 2 for blocks in plan.served.values()), "no taker of two senders"
    assert {(True, False), (False, True)} <= {(b.backward, b.taker_action.kind.is_backward) for b in plan.blocks}
    cuts = {x for b in plan.blocks for x in (b.kv_start, b.kv_end) if x % LENGTH}
    assert cuts and all(x % CHUNK for x in cuts), cuts  # inside a cached slice and inside a zigzag chunk
    assert any(_rows(0, b.kv_start, b.kv_end) != _rows(1, b.kv_start, b.kv_end) for b in plan.blocks)


def test_block_plan_under_cp_matches_single_process_reference():
    plan = _plan()
    configs = [(MICROBATCHES, LENGTHS, plan.to_text())]
    results = run_ranks(_cp_block_workers.run_blocks_cp, PP * CP, CP, configs, timeout_s=900)
    _check([[r[:4] for r in rank_results] for rank_results in results], [(1, MICROBATCHES, LENGTHS, "cp")])
    sent = [r[0][4] for r in results]
    served = [r[0][5] for r in results]
    # megatron's rank order is tp-cp-dp-pp: global rank = pp rank * cp + cp rank (tp = dp = 1)
    expected_sent = [
        sum(_rows(rank % CP, b.kv_start, b.kv_end) * LAYERS for b in plan.blocks if b.sender == rank // CP)
        for rank in range(PP * CP)
    ]
    takers = Counter(b.taker for b in plan.blocks)
    assert sent == expected_sent and sum(sent) > 0, (sent, expected_sent)
    assert served == [takers[rank // CP] * LAYERS for rank in range(PP * CP)], served
