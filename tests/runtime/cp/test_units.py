"""Single-process checks of the CP runtime's pieces: head split, pair rule, legs of routed hops,
queue interpreter, program errors, the batch cut and the loss normalisation."""

import pytest
import torch

from megatron_slim.plan.cp.routing import RoutePart
from megatron_slim.runtime.cp import compile_rank, run_queues, split_heads
from megatron_slim.runtime.cp.block_attention import Rows, pair_calls
from megatron_slim.runtime.cp.exchange import Exchange, Hop
from megatron_slim.runtime.cp.run_context import HeadShape
from megatron_slim.runtime.cp.spans import block_of
from tests.runtime.cp import _plans, _workers


def test_heads_split_or_replicate_kv_heads():
    s = split_heads(8, 4, 2)
    assert s.q == ((0, 4), (4, 8)) and s.kv == ((0, 2), (2, 4))
    r = split_heads(4, 1, 4)  # one K/V head shared by every member
    assert r.q == ((0, 1), (1, 2), (2, 3), (3, 4)) and r.kv == ((0, 1),) * 4
    g = split_heads(4, 2, 4)
    assert g.kv == ((0, 1), (0, 1), (1, 2), (1, 2))


@pytest.mark.parametrize("hq,hkv,ways,text", [(6, 2, 4, "divisible by 4"), (6, 3, 2, "do not align")])
def test_heads_refused_with_a_clear_error(hq, hkv, ways, text):
    with pytest.raises(ValueError, match=text):
        split_heads(hq, hkv, ways)


def test_ulysses_with_too_few_heads_fails_at_compile_time():
    plan, _ = _plans.case("ulysses")
    with pytest.raises(ValueError, match="ulysses group 0 of 4 ranks cannot share 6 query heads"):
        compile_rank(plan, 0, HeadShape(6, 2, 8, 8))


def test_pair_rule_full_causal_and_nothing():
    mine = block_of([(0, 0, 3), (0, 9, 12)])  # zigzag chunks 0 and 3 of a 12-token sequence
    theirs = block_of([(0, 3, 6), (0, 6, 9)])  # chunks 1 and 2
    calls = pair_calls(mine, theirs, own=False)
    assert len(calls) == 1 and not calls[0].causal
    assert calls[0].q.runs == ((3, 3),) and calls[0].k.runs == ((0, 6),)  # only chunk 3 sees them
    own = pair_calls(mine, mine, own=True)
    assert [c.causal for c in own] == [True]
    assert own[0].cu_q == (0, 3, 6) and own[0].cu_k == (0, 3, 9)  # chunk 3 sees chunk 0, then itself
    with pytest.raises(ValueError, match="overlap"):
        pair_calls(block_of([(0, 0, 4)]), block_of([(0, 2, 6)]), own=False)


def test_rows_slice_or_index():
    x = torch.arange(10.0)
    assert Rows.of([(2, 3), (5, 2)]).runs == ((2, 5),)
    rows = Rows.of([(0, 2), (6, 2)])
    assert rows.take(x).tolist() == [0, 1, 6, 7]
    rows.add(x, torch.ones(4))
    assert x.tolist() == [1, 2, 2, 3, 4, 5, 7, 8, 8, 9]


def test_routed_hop_legs_dispatch_nic_combine():
    # 2 nodes x 2: hop 1 -> 2 split in two parts; part 0 leaves through rank 0, lands on rank 2
    # directly; part 1 leaves through rank 1 itself and is combined from rank 3.
    hop = Hop(1, 2, 10, 4, (RoutePart(0, 2, 0, 5), RoutePart(1, 3, 5, 10)))
    ex = Exchange("test", (hop,))
    legs = [(leg.stage, leg.sender, leg.receiver, leg.start) for leg in ex.legs]
    assert legs == [(1, 1, 0, 0), (1, 1, 3, 5), (2, 0, 2, 0), (2, 3, 2, 5)]
    assert ex.involves(0) and ex.involves(3)
    with pytest.raises(ValueError, match="do not tile"):
        Exchange("bad", (Hop(1, 2, 10, 4, (RoutePart(0, 2, 0, 4),)),))


def test_queues_advance_round_robin_in_order():
    log = []

    def task(name, rounds):
        for r in range(rounds):
            log.append((r, name))
            yield
        return name

    assert run_queues([task("inter", 3), task("intra", 2), task("local", 1)]) == [
        "inter",
        "intra",
        "local",
    ]
    assert log == [(0, "inter"), (0, "intra"), (0, "local"), (1, "inter"), (1, "intra"), (2, "inter")]


def test_cp_batch_cuts_the_pack_in_layout_order():
    from megatron_slim.megatron.cp.data import cp_batch, layout_index

    plan, _ = _plans.case("zeppelin")
    pack = _workers.make_pack(plan.lengths, 50, seed=3)
    pack["attention_mask"] = None
    for rank in range(plan.num_ranks):
        batch = cp_batch(pack, plan, rank)
        idx = layout_index(plan, rank)
        assert torch.equal(batch["tokens"][0], pack["tokens"][idx])
        assert torch.equal(batch["loss_mask"][0], pack["loss_mask"][idx])
        assert batch["position_ids"][0].tolist() == plan.ranks[rank].position_ids()
        assert "attention_mask" not in batch
    with pytest.raises(ValueError, match="one pack"):
        cp_batch({"tokens": torch.zeros(3, dtype=torch.long)}, plan, 0)


def test_a_rank_without_tokens_gets_one_padding_row_kept_out_of_the_loss():
    """What both data paths (``megatron-slim train`` and Megatron-LM's get_batch hook) hand the model."""
    from megatron_slim.megatron.cp.data import cp_batch
    from megatron_slim.megatron.cp.hooks import local_batch

    plan, _ = _plans.case("ones-ring")
    empty = [r for r in range(plan.num_ranks) if plan.ranks[r].num_tokens == 0]
    assert empty
    pack = _workers.make_pack(plan.lengths, 50, seed=3)
    for rank in empty:
        batch = cp_batch(pack, plan, rank)
        assert [batch[k].shape for k in ("tokens", "labels", "loss_mask", "position_ids")] == [(1, 1)] * 4
        assert batch["loss_mask"].sum() == 0 and batch["position_ids"].tolist() == [[0]]
        hooked = local_batch({**pack, "attention_mask": torch.ones(1), "position_ids": torch.arange(6)}, plan, rank)
        assert hooked["attention_mask"] is None and hooked["loss_mask"].tolist() == [[0.0]]
        assert hooked["position_ids"].tolist() == [[0]]
    with pytest.raises(ValueError, match="loss_mask"):
        cp_batch({"tokens": pack["tokens"], "labels": pack["labels"]}, plan, empty[0])
    assert cp_batch({"tokens": pack["tokens"]}, plan, empty[0])["tokens"].shape == (1, 1)  # no loss on this stage


def test_cp_loss_func_normalisation_without_a_group():
    from megatron_slim.megatron.cp.data import cp_loss_func

    losses, mask = torch.tensor([[1.0, 2.0, 4.0]]), torch.tensor([[1.0, 0.0, 1.0]])
    loss, n, report = cp_loss_func(mask, losses, None)
    assert loss.item() == 5.0 and n.item() == 2 and report["lm loss"].tolist() == [5.0, 2.0]
    loss, n, _ = cp_loss_func(mask, losses, None, per_token_loss=True)
    assert loss.item() == 5.0 and n.item() == 2


def test_plan_microbatch_builds_what_the_simulator_prices():
    from megatron_slim.megatron.cp.data import plan_microbatch
    from megatron_slim.plan.cp.engines import plan_pack

    lengths = _plans.zeppelin_plan().lengths
    plan, routing, remap = plan_microbatch(lengths, _plans.topology(), _plans.costs(), remap=True)
    assert plan.digest() == plan_pack("zeppelin", lengths, _plans.topology(), _plans.costs()).digest()
    assert routing is not None and remap is not None and remap.source_tokens == plan.tokens_per_rank()
    ring, no_routes, no_remap = plan_microbatch(lengths, _plans.topology(), _plans.costs(), engine="ring", remap=True)
    assert ring.engine == "ring" and no_routes is None and no_remap is None
