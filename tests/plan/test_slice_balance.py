"""With long sequences, uniform slices cost more the later they come (causal attention), which
shows up as extra bubble; the balanced policy removes most of it."""

import pytest

from megatron_slim.plan.cost.slicing import balanced_slices, slice_prefixes, uniform_slices
from megatron_slim.plan.recipe import load_recipe
from megatron_slim.plan.schedule import generate
from megatron_slim.plan.sim.costs import RecipeCosts
from megatron_slim.plan.sim.engine import simulate


def _simulate(recipe_name, *overrides):
    r = load_recipe(recipe_name, list(overrides))
    costs = RecipeCosts(r)
    p = r.parallel
    res = simulate(generate(r.schedule.kind, p.pp, p.vpp, r.num_microbatches, r.schedule.num_slices), costs)
    return r, costs, res


@pytest.mark.parametrize("recipe", ["llama2-7b-64k", "llama2-13b-128k"])
def test_uniform_slices_grow_costlier_and_balanced_removes_most_of_the_extra_bubble(recipe):
    r, uni_costs, uniform = _simulate(recipe, "schedule.slice_policy=uniform")
    _, bal_costs, balanced = _simulate(recipe, "schedule.slice_policy=balanced")
    n = r.schedule.num_slices
    fwd = [uni_costs.forward(1, 0, j) + uni_costs.backward(1, 0, j) for j in range(n)]
    assert all(a < b for a, b in zip(fwd, fwd[1:])), "later uniform slices must cost more"
    assert fwd[-1] > 1.5 * fwd[0]
    analytic = (r.parallel.pp - 1) / (r.num_microbatches * n * r.parallel.vpp + r.parallel.pp - 1)
    extra_uniform = uniform.bubble_ratio - analytic
    extra_balanced = balanced.bubble_ratio - analytic
    assert extra_uniform > 2 * analytic
    assert extra_balanced < 0.35 * extra_uniform
    assert balanced.iteration_time_s < uniform.iteration_time_s
    work = [bal_costs.forward(1, 0, j) + bal_costs.backward(1, 0, j) for j in range(n)]
    assert max(work) / min(work) < 1.1


def test_balanced_boundaries_equalise_modelled_work():
    lengths = balanced_slices(65536, 8, per_token=1.0, per_pair=1e-3, alignment=16)
    assert sum(lengths) == 65536 and all(n % 16 == 0 for n in lengths)
    assert list(lengths) == sorted(lengths, reverse=True)
    work = [n + 1e-3 * (n * p + n * (n + 1) / 2) for n, p in zip(lengths, slice_prefixes(lengths))]
    assert max(work) / min(work) < 1.01


def test_balanced_without_attention_is_uniform_and_alignment_is_kept():
    assert balanced_slices(1024, 4, per_token=1.0, per_pair=0.0, alignment=8) == (256,) * 4
    assert all(n >= 8 for n in balanced_slices(64, 8, per_token=0.0, per_pair=1.0, alignment=8))


@pytest.mark.parametrize("seq,n,unit", [(100, 3, 1), (1024, 5, 8), (64, 16, 8)])
def test_impossible_slicing_names_the_field(seq, n, unit):
    with pytest.raises(ValueError, match="schedule.num_slices"):
        uniform_slices(seq, n, unit) if seq % (n * unit) or n * unit > seq else balanced_slices(seq, n, 1, 1, unit)
