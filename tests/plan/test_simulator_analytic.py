"""Where attention (short sequences), the embedding/output layers (small vocab) and links are
negligible, the simulator must reproduce the closed-form bubble and stage-0 memory of each schedule
within 2%. A is one microbatch's activations on one pipeline rank (all of its chunks)."""

import pytest

from megatron_slim.plan.recipe import recipe_from_dict
from megatron_slim.plan.schedule import generate
from megatron_slim.plan.sim.costs import RecipeCosts
from megatron_slim.plan.sim.engine import simulate


def _run(profile, kind, pp, vpp, m, n):
    recipe = recipe_from_dict(
        {
            "hardware": profile,
            "model": {
                "num_layers": 8 * pp * vpp,
                "hidden_size": 8192,
                "ffn_hidden_size": 28672,
                "num_attention_heads": 64,
                "num_query_groups": 8,
                "vocab_size": 8,
                "seq_length": 8 * n * max(1, 8 // n),
            },
            "parallel": {"pp": pp, "vpp": vpp},
            "schedule": {"kind": kind, "num_slices": n},
            "train": {"global_batch_size": m},
        }
    )
    costs = RecipeCosts(recipe)
    result = simulate(generate(kind, pp, vpp, m, n), costs)
    a = sum(costs.cost.activation_bytes(recipe.parallel.pp * c, recipe.model.seq_length) for c in range(vpp))
    return result, a


def _close(value, expected, rel=0.02):
    return abs(value - expected) <= rel * expected


@pytest.mark.parametrize("p,m", [(4, 8), (4, 16), (8, 16), (2, 5)])
def test_1f1b(fast_links_profile, p, m):
    r, a = _run(fast_links_profile, "1f1b", p, 1, m, 1)
    assert _close(r.bubble_ratio, (p - 1) / (m + p - 1))
    assert _close(r.ranks[0].peak_activation_bytes, p * a)


@pytest.mark.parametrize("p,v,m", [(4, 2, 8), (4, 4, 8), (8, 2, 16), (4, 3, 12)])
def test_interleaved(fast_links_profile, p, v, m):
    r, a = _run(fast_links_profile, "interleaved", p, v, m, 1)
    assert _close(r.bubble_ratio, (p - 1) / (v * m + p - 1))
    assert _close(r.ranks[0].peak_activation_bytes, a * (p + (p - 1) / v))


@pytest.mark.parametrize("p,v,m,n", [(4, 2, 4, 8), (4, 4, 4, 8), (8, 2, 4, 16), (4, 2, 8, 4), (8, 4, 2, 8)])
def test_slimpipe_interleaved(fast_links_profile, p, v, m, n):
    r, a = _run(fast_links_profile, "slimpipe", p, v, m, n)
    assert _close(r.bubble_ratio, (p - 1) / (m * n * v + p - 1))
    assert _close(r.ranks[0].peak_activation_bytes, a * (1 + 2 * (p - 1) / (n * v)))


@pytest.mark.parametrize("p,m,n", [(4, 8, 8), (4, 4, 4), (8, 4, 16), (2, 3, 5), (4, 2, 6)])
def test_slimpipe_one_chunk_holds_less_than_the_paper_bound(fast_links_profile, p, m, n):
    """With one chunk the 1F1B round trip is p-r-1 slices, not 2(p-r-1): stage 0 holds
    A(1 + (p-1)/n), below the paper's A(1 + 2(p-1)/n), at the same bubble."""
    r, a = _run(fast_links_profile, "slimpipe", p, 1, m, n)
    assert _close(r.bubble_ratio, (p - 1) / (m * n + p - 1))
    assert _close(r.ranks[0].peak_activation_bytes, a * (1 + (p - 1) / n))
    assert r.ranks[0].peak_activation_bytes < a * (1 + 2 * (p - 1) / n)
