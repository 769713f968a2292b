"""Packing plans timed by the pipeline simulator: ``PackedCosts`` and ``simulate_plan``."""

import math
from types import SimpleNamespace

import pytest

from megatron_slim.commands.simulate import run_one
from megatron_slim.plan.cost.model import CostModel, Link
from megatron_slim.plan.pack.pipeline_costs import PackedCosts, cut_micropack
from megatron_slim.plan.pack.plan import MicroPack, PackingPlan, Piece
from megatron_slim.plan.pack.simulate import simulate_plan
from megatron_slim.plan.recipe import load_recipe

C, A, K = 1.0, 10.0, 100.0  # fixed part, per token, per causal query-key pair (forward)
KV_PER_TOKEN, ACT_PER_TOKEN, BANDWIDTH = 3.0, 7.0, 2.0


def pairs(n, prefix):
    return n * prefix + n * (n + 1) / 2


class StubCost:
    """A cost model whose times are ``c + a n + k pairs`` (backward: twice forward)."""

    recipe = SimpleNamespace(parallel=SimpleNamespace(dp=2))
    shape = SimpleNamespace(kv_bytes=lambda n: KV_PER_TOKEN * n)
    layers_per_stage = 2

    def forward_time(self, stage, n, prefix):
        return C + A * n + K * pairs(n, prefix)

    def backward_time(self, stage, n, prefix):
        return 2 * self.forward_time(stage, n, prefix)

    def weight_grad_time(self, stage, n, prefix):
        return A * n

    def kv_bytes(self, stage, n):
        return KV_PER_TOKEN * n * self.layers_per_stage

    def activation_bytes(self, stage, n):
        return ACT_PER_TOKEN * n

    def gpu_index(self, **_):
        return 0

    def link(self, a, b):
        return Link(BANDWIDTH, 0.0, True)


# Document 0 whole (3 tokens); document 1's tokens 5..8, its first 5 tokens ran elsewhere.
PACK = MicroPack((Piece(0, 0, 3), Piece(1, 5, 4)), 0.0, 0.0, 0.0)


def test_one_slice_pays_the_fixed_part_once_and_each_piece_its_own_prefix():
    costs = PackedCosts(StubCost(), [PACK], num_slices=1)
    # c + a*(3+4) + k*(pairs(3, 0) + pairs(4, 5)) = 1 + 70 + 100*(6 + 30)
    assert costs.forward(0, 0, 0) == pytest.approx(3671.0)
    assert costs.backward(0, 0, 0) == pytest.approx(2 * 3671.0)
    assert costs.weight_grad(0, 0, 0) == pytest.approx(70.0 - 0.0)
    assert costs.activation_bytes(0, 0, 0) == 7 * 7
    # the slice's own K/V (7 tokens, 2 layers) plus document 1's 5 prefix tokens held (2 layers)
    assert costs.kv_bytes(0, 0, 0) == 3 * 7 * 2 + 3 * 5 * 2


def test_two_slices_cut_the_packed_sequence_across_a_document_boundary():
    slices = cut_micropack(PACK, 2)
    assert [s.pieces for s in slices] == [(Piece(0, 0, 3), Piece(1, 5, 1)), (Piece(1, 6, 3),)]
    assert [s.external_prefix for s in slices] == [5, 0]
    costs = PackedCosts(StubCost(), [PACK], num_slices=2)
    # slice 0: c + a*4 + k*(pairs(3, 0) + pairs(1, 5)) = 1 + 40 + 100*(6 + 6)
    # slice 1: c + a*3 + k*pairs(3, 6) = 1 + 30 + 100*24
    assert [costs.forward(0, 0, j) for j in (0, 1)] == pytest.approx([1241.0, 2431.0])
    assert costs.kv_bytes(0, 0, 0) == 3 * 4 * 2 + 3 * 5 * 2 and costs.kv_bytes(0, 0, 1) == 3 * 3 * 2


def test_a_document_spread_over_dp_ranks_pays_for_its_prefix_kv():
    costs = PackedCosts(StubCost(), [PACK], num_slices=1, spread=frozenset({1}))
    moved = 3.0 * 2 * 5 / BANDWIDTH  # kv_bytes(stage, 1 token) * prefix 5 / bandwidth
    assert costs.forward(0, 0, 0) == pytest.approx(3671.0 + moved)
    assert costs.backward(0, 0, 0) == pytest.approx(2 * 3671.0 + 2 * moved)


def test_a_one_piece_micropack_costs_what_the_cost_model_says():
    cost = CostModel(load_recipe("llama2-7b-64k"))
    pack = MicroPack((Piece(0, 4096, 8192),), 0.0, 0.0, 0.0)
    costs = PackedCosts(cost, [pack], num_slices=1)
    for stage in range(4):
        assert costs.forward(stage, 0, 0) == pytest.approx(cost.forward_time(stage, 8192, 4096))
        assert costs.backward(stage, 0, 0) == pytest.approx(cost.backward_time(stage, 8192, 4096))


def test_whole_sequence_micropacks_simulate_like_the_unpacked_recipe():
    """One document of model.seq_length per MicroPack is the unpacked pipeline, slice for slice."""
    recipe = load_recipe("tiny-cpu", ["parallel.dp=2", "parallel.pp=2"])
    seq, per_rank = recipe.model.seq_length, recipe.num_microbatches
    ranks = tuple(
        tuple(MicroPack((Piece(r * per_rank + m, 0, seq),), 1.0, 2.0, 0.0) for m in range(per_rank)) for r in range(2)
    )
    plan = PackingPlan("t", (seq,) * (2 * per_rank), seq, math.inf, ranks)
    cost = CostModel(recipe)
    packed = simulate_plan(plan, cost)
    reference = run_one(recipe).result
    assert packed.iteration_time_s == pytest.approx(reference.iteration_time_s, rel=1e-9)
    assert packed.peak_memory_bytes == pytest.approx(max(r.peak_memory_bytes for r in reference.ranks), rel=1e-9)
    assert packed.mfu == pytest.approx(reference.mfu, rel=1e-9)
    assert packed.fwd_imbalance == 1.0 and packed.padding_share == 0.0
