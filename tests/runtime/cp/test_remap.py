"""The remap layer's move alone (4 gloo ranks): tokens land where the ``RemapPlan`` says, the
per-pair counts are the plan's ``send_counts``, the round trip is the identity and the backward
moves each token's gradient back to it (all exact: only copies)."""

import pytest
import torch

from tests.runtime.cp import _plans, _workers
from tests.runtime.cp.conftest import WORLD


def _expected_ids(plan, remap):
    """Token ids (pack positions) every rank must hold after the move, built from the plan alone."""
    source = [_workers.layout_index(plan, r).tolist() for r in range(WORLD)]
    target = [[None] * n for n in remap.target_tokens]
    for r in range(WORLD):
        target[r][: remap.keep[r]] = source[r][: remap.keep[r]]
    for t in remap.transfers:
        target[t.dst][t.dst_start : t.dst_end] = source[t.src][t.src_start : t.src_end]
    return source, target


@pytest.mark.parametrize("name", _workers.REMAP_CASES)
def test_tokens_move_exactly_as_planned(engine_results, name):
    plan, _ = _plans.case(name)
    remap = _plans.remap_for(plan)
    source, target = _expected_ids(plan, remap)
    owner = {tok: r for r in range(WORLD) for tok in source[r]}
    counts = [[0] * WORLD for _ in range(WORLD)]
    for r in range(WORLD):
        y = engine_results[r]["remap"][name]["y"]
        assert y.shape[0] == remap.target_tokens[r]
        ids = y[:, 0, 0].long().tolist()
        assert ids == target[r]
        torch.testing.assert_close(y[:, 0, 1], -y[:, 0, 0], atol=0, rtol=0)
        for tok in ids[remap.keep[r] :]:
            counts[owner[tok]][r] += 1
    assert tuple(map(tuple, counts)) == remap.send_counts()
    assert sum(map(sum, counts)) == remap.moved_tokens


def test_skewed_plan_moves_tokens_across_nodes():
    remap = _plans.remap_for(_plans.case("skewed")[0])
    assert remap.moved_tokens > 0 and remap.inter_node_tokens > 0
    assert max(remap.target_tokens) - min(remap.target_tokens) <= 1


@pytest.mark.parametrize("name", _workers.REMAP_CASES)
def test_round_trip_is_identity_and_backward_is_the_inverse_move(engine_results, name):
    for r in range(WORLD):
        res = engine_results[r]["remap"][name]
        assert torch.equal(res["back"], res["x"])
        ids = res["x"][:, 0, 0]
        # d/dx sum(y * w(y_id)) = w(x_id) for the row that became y
        want = torch.stack([torch.sin(ids), torch.cos(ids), ids**2], dim=1).unsqueeze(1)
        torch.testing.assert_close(res["grad"], want, atol=0, rtol=0)
