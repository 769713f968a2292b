"""SlimPack packing plans: validity for every method, the every-token-once invariant, pricing."""

import math
import random

import pytest

from megatron_slim.plan.cost.model import CostModel
from megatron_slim.plan.pack.baselines import BASELINES, plan_baseline
from megatron_slim.plan.pack.costs import SliceCosts, causal_pairs, fit_slice_costs
from megatron_slim.plan.pack.evaluate import evaluate, imbalance
from megatron_slim.plan.pack.plan import MicroPack, PackingPlan, Piece
from megatron_slim.plan.pack.slimpack import solve
from megatron_slim.plan.recipe import load_recipe
from megatron_slim.plan.schema import ConfigError

COSTS = SliceCosts(1e-6, 2e-11, 2e-6, 6e-11, 1000.0, 1e-8)
CAP = 4096


def random_lengths(seed, count=120):
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        mean = 16384 if rng.random() < 0.1 else 1024
        out.append(max(1, min(65536, int(rng.lognormvariate(math.log(mean) - 0.5, 1.0)))))
    return out


def every_plan(lengths, dp, memory_cap=math.inf):
    plans = [plan_baseline(m, lengths, COSTS, dp, CAP, memory_cap) for m in BASELINES]
    return plans + [solve(lengths, COSTS, dp, CAP, memory_cap, budget_s=0.2).plan]


def tiles_every_sample(plan):
    """Each sample's pieces, sorted by start, follow one another from token 0 to its end: every
    token appears once, none twice (checked by intervals, not through the plan's own check)."""
    pieces = [[] for _ in plan.sample_lengths]
    for packs in plan.ranks:
        for pack in packs:
            for p in pack.pieces:
                pieces[p.sample].append((p.start, p.length))
    for n, own in zip(plan.sample_lengths, pieces):
        end = 0
        for start, length in sorted(own):
            if start != end or length < 1:
                return False
            end = start + length
        if end != n:
            return False
    return True


@pytest.mark.parametrize("seed", range(4))
def test_every_method_covers_every_token_exactly_once_within_the_caps(seed):
    lengths = random_lengths(seed)
    memory_cap = 3000 * 1000.0  # 3000 tokens' activations: tighter than the token cap
    plans = every_plan(lengths, dp=8, memory_cap=memory_cap)
    assert [p.method for p in plans] == [*BASELINES, "slimpack"]
    for plan in plans:
        assert tiles_every_sample(plan), plan.method
        for packs in plan.ranks:
            for pack in packs:
                assert pack.tokens <= 3000 and pack.memory_bytes <= memory_cap, plan.method
        assert plan.dp == 8


def test_micropacks_are_priced_from_their_pieces_prefixes():
    lengths = [10000, 300, 500]
    plan = solve(lengths, COSTS, 2, CAP, budget_s=0.0).plan
    for packs in plan.ranks:
        for pack in packs:
            want = 0.0
            for p in pack.pieces:
                pairs = p.length * p.start + p.length * (p.length + 1) / 2
                want += 1e-6 * p.length + 2e-11 * pairs
            # A document split over both replicas also pays for the prefix K/V it receives.
            spread = {p.sample for p in pack.pieces} & {
                q.sample for other in plan.ranks if other is not packs for m in other for q in m.pieces
            }
            want += sum(1e-8 * p.start for p in pack.pieces if p.sample in spread)
            assert pack.forward_s == pytest.approx(want, rel=1e-12)


def _plan(ranks, lengths=(5, 3), cap=8, memory_cap=math.inf):
    packs = tuple(tuple(MicroPack(tuple(Piece(*p) for p in m), 1.0, 2.0, 0.0) for m in r) for r in ranks)
    return PackingPlan("t", tuple(lengths), cap, memory_cap, packs)


def test_the_plan_value_refuses_lost_duplicated_or_reordered_tokens_and_overfull_packs():
    ok = _plan([[[(0, 0, 5)]], [[(1, 0, 3)]]])
    assert ok.rank_forward() == (1.0, 1.0) and ok.rank_backward() == (2.0, 2.0)
    with pytest.raises(ConfigError, match="sample 1 covers 2 of its 3"):
        _plan([[[(0, 0, 5), (1, 0, 2)]]])
    with pytest.raises(ConfigError, match="every token exactly once"):
        _plan([[[(0, 0, 5), (1, 0, 3)]], [[(1, 2, 1)]]])
    with pytest.raises(ConfigError, match="holds 8 > cap 7"):
        _plan([[[(0, 0, 5), (1, 0, 3)]]], cap=7)
    with pytest.raises(ConfigError, match="after a later piece"):
        _plan([[[(0, 3, 2)], [(0, 0, 3), (1, 0, 3)]]])
    with pytest.raises(ConfigError, match="needs 11 B > cap 10"):
        PackingPlan("t", (1,), 8, 10.0, ((MicroPack((Piece(0, 0, 1),), 0.0, 0.0, 11.0),),))


def test_text_and_digest_name_every_piece():
    plan = _plan([[[(0, 0, 5)]], [[(1, 0, 3)]]])
    assert "r1 m0 fwd=1 bwd=2 | 1:0+3" in plan.text()
    assert (
        plan.digest()
        == _plan([[[(0, 0, 5)]], [[(1, 0, 3)]]]).digest()
        != _plan([[[(1, 0, 3)]], [[(0, 0, 5)]]]).digest()
    )


def test_evaluation_follows_the_pipeline_formula():
    plan = _plan([[[(0, 0, 5)], [(1, 0, 3)]], []], lengths=(5, 3))
    m = evaluate(plan, pp=4)
    assert m.iteration_time_s == pytest.approx(2 * 3.0 + 3 * 3.0)
    assert m.tokens_per_s == pytest.approx(8 / 15.0)
    assert m.padding_share == pytest.approx(1 - 8 / 16)
    assert (m.fwd_imbalance, m.bwd_imbalance) == (2.0, 2.0)
    assert imbalance([1.0, 3.0]) == 1.5


def test_fitted_slice_costs_match_the_cost_model_and_follow_recompute():
    cost = CostModel(load_recipe("llama2-7b-64k"))
    fit = fit_slice_costs(cost, 4096, 65536)
    # Exact where fitted (a first slice, one at the longest prefix); a fit elsewhere.
    for tokens, prefix, rel in ((4096, 0, 1e-9), (4096, 65536, 1e-9), (2048, 30000, 5e-2), (8192, 8192, 5e-2)):
        assert fit.forward(tokens, prefix) == pytest.approx(cost.forward_time(1, tokens, prefix), rel=rel)
        assert fit.backward(tokens, prefix) == pytest.approx(cost.backward_time(1, tokens, prefix), rel=rel)
    full = fit_slice_costs(CostModel(load_recipe("llama2-7b-64k", ["train.recompute=full"])), 4096, 65536)
    assert full.bwd_per_pair > fit.bwd_per_pair and full.fwd_per_pair == pytest.approx(fit.fwd_per_pair)
    assert fit.bwd_per_pair / fit.fwd_per_pair > fit.bwd_per_token / fit.fwd_per_token  # asymmetric


def test_balanced_slices_cost_at_most_a_first_slice():
    budget = COSTS.forward(4096, 0) + COSTS.backward(4096, 0)
    for prefix in (0, 50000, 10**6):
        size = COSTS.longest_within(budget, prefix)
        assert COSTS.forward(size, prefix) + COSTS.backward(size, prefix) <= budget * (1 + 1e-9)
        assert COSTS.forward(size + 1, prefix) + COSTS.backward(size + 1, prefix) > budget
    assert COSTS.longest_within(budget, 0) == 4096
    assert causal_pairs(3, 2) == 3 * 2 + 6


def test_wlb_keeps_an_outlier_when_long_documents_fill_the_micropack_count():
    # 300 tokens make two chained MicroPacks, as many as 500 tokens need: the 200-token outlier
    # (over cap / 2) still gets a MicroPack of its own
    plan = plan_baseline("wlb", [300, 200], COSTS, 1, 256)
    assert sorted(m.pieces for m in plan.ranks[0])[-1] == (Piece(1, 0, 200),)
