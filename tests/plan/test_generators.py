"""Property tests over grids of (pp, vpp, microbatches, slices), odd and non-divisible sizes included."""

import itertools

import pytest

from megatron_slim.plan.schedule import (
    Kind,
    add_communication,
    generate,
    interleaved,
    one_f_one_b,
    slimpipe,
    split_backward,
    validate,
)

GRID = list(itertools.product([1, 2, 3, 4, 5, 8], [1, 2, 3], [1, 2, 3, 5, 8, 9], [1, 2, 3, 4, 6, 8]))


# The plan tier validates every fifth point (a stride prime to each axis's length, so every value of
# every axis appears); the slow tier (`make test-slow`) validates the other four fifths.
GRID_PLAN_TIER = [
    pytest.param(*g) if i % 5 == 0 else pytest.param(*g, marks=pytest.mark.slow) for i, g in enumerate(GRID)
]


@pytest.mark.parametrize("pp,vpp,m,n", GRID_PLAN_TIER)
def test_slimpipe_grid_is_complete_and_deadlock_free(pp, vpp, m, n):
    s = slimpipe(pp, m, n, vpp)
    validate(s)
    validate(add_communication(s))


@pytest.mark.parametrize("pp,vpp,m,n", [g for g in GRID if g[3] in (1, 3)][::3])
def test_split_backward_variants_validate(pp, vpp, m, n):
    validate(add_communication(split_backward(slimpipe(pp, m, n, vpp))))


@pytest.mark.parametrize("pp,vpp,m,n", GRID[::5])
def test_slices_go_forward_in_order_and_backward_in_reverse(pp, vpp, m, n):
    s = slimpipe(pp, m, n, vpp)
    for row in s.ranks:
        for chunk, mb in itertools.product(range(vpp), range(m)):
            fw = [a.slice for a in row if a.kind is Kind.F and (a.chunk, a.microbatch) == (chunk, mb)]
            bw = [a.slice for a in row if a.kind is Kind.B and (a.chunk, a.microbatch) == (chunk, mb)]
            assert fw == list(range(n))
            assert bw == list(reversed(range(n)))


@pytest.mark.parametrize("pp,m", [(1, 1), (2, 1), (4, 3), (4, 8), (5, 7)])
def test_1f1b_warmup_matches_megatron(pp, m):
    s = one_f_one_b(pp, m)
    for r, row in enumerate(s.ranks):
        first_b = next(i for i, a in enumerate(row) if a.kind is Kind.B)
        assert first_b == min(pp - r - 1, m - 1) + 1
        # after warmup it strictly alternates F, B while forwards remain
        kinds = [a.kind for a in row[first_b - 1 : first_b - 1 + 2 * (m - first_b)]]
        assert kinds == [Kind.F, Kind.B] * (m - first_b) or first_b == m


@pytest.mark.parametrize("pp,vpp,m", [(2, 2, 4), (4, 2, 8), (4, 3, 12), (3, 2, 6)])
def test_interleaved_forward_order_is_megatrons_schedule_table(pp, vpp, m):
    """Megatron's get_schedule_table with group size pp: groups of pp microbatches per chunk."""
    expected = [(c, mb) for g in range(0, m, pp) for c in range(vpp) for mb in range(g, min(g + pp, m))]
    for r, row in enumerate(interleaved(pp, vpp, m).ranks):
        assert [(a.chunk, a.microbatch) for a in row if a.kind is Kind.F] == expected
        warmup = next(i for i, a in enumerate(row) if a.kind is Kind.B) - 1
        assert warmup == min((vpp - 1) * pp + 2 * (pp - r - 1), vpp * m - 1)


def test_slimpipe_with_one_slice_equals_1f1b_and_interleaved():
    assert slimpipe(4, 6, 1).ranks == one_f_one_b(4, 6).ranks
    assert slimpipe(4, 8, 1, vpp=2).ranks == interleaved(4, 2, 8).ranks


@pytest.mark.parametrize(
    "bad",
    [
        dict(kind="zb", pp=2, vpp=1, num_microbatches=2, num_slices=1),
        dict(kind="1f1b", pp=2, vpp=2, num_microbatches=2, num_slices=1),
        dict(kind="interleaved", pp=2, vpp=1, num_microbatches=2, num_slices=1),
        dict(kind="slimpipe", pp=0, vpp=1, num_microbatches=2, num_slices=1),
    ],
)
def test_bad_generator_arguments_are_named(bad):
    with pytest.raises(ValueError, match="allowed|expected|takes"):
        generate(**bad)
