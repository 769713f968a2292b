"""Query-out context-parallel slice attention equals whole-sequence causal attention (float64).

Each CP rank holds the zigzag shard of every slice and caches only its own K/V; outputs and
dQ/dK/dV, gathered back to global positions, must equal single-process causal attention over the
whole sequence. Tolerance atol 1e-6 / rtol 1e-5: inputs are float64 but log-sum-exp values and the
cache's dK/dV buffers are float32 (as in the non-CP slice attention test)."""

import pytest
import torch

from megatron_slim.runtime.pipeline.zigzag import ZigzagLayout
from megatron_slim.runtime.spawn import run_ranks
from tests.oracle.attention import library_reference_grads
from tests.runtime.pipeline import _cp_workers

TOL = dict(atol=1e-6, rtol=1e-5)
CASES = [
    ("reference", (32,)),
    ("reference", (8, 8, 8, 8)),
    ("reference", (16, 8, 8)),
    ("sdpa", (8, 16, 8)),
    ("reference", (8, 24)),
]


@pytest.mark.parametrize("cp,length", [(1, 6), (2, 8), (3, 24), (4, 16)])
def test_zigzag_layout_round_trip_and_positions(cp, length):
    layout = ZigzagLayout(cp, length)
    per_rank = [layout.positions(r) for r in range(cp)]
    rank_major = torch.cat(per_rank)
    assert sorted(rank_major.tolist()) == list(range(length))
    x = rank_major.view(1, -1, 1).double()
    assert torch.equal(layout.to_positions(x, 1).view(-1), torch.arange(length).double())
    y = torch.randn(2, 3, length)
    assert torch.equal(layout.to_positions(layout.to_rank_major(y, 2), 2), y)
    # the key blocks of a rank cover exactly the causal (query, key) pairs of its keys
    c = layout.chunk
    for r in range(cp):
        seen = torch.zeros(length, length, dtype=torch.bool)
        for t, first, n, causal in layout.key_blocks(r):
            keys = per_rank[r][t * c : (t + 1) * c]
            block = torch.ones(n, c, dtype=torch.bool)
            seen[first : first + n, keys] = block.tril() if causal else block
        want = torch.ones(length, length, dtype=torch.bool).tril()
        mine = torch.zeros(length, dtype=torch.bool)
        mine[per_rank[r]] = True
        assert torch.equal(seen, want & mine)


def test_zigzag_layout_refuses_unaligned_slices():
    with pytest.raises(ValueError, match="multiples of 2\\*cp=4"):
        ZigzagLayout(2, 10)


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_slices_equal_whole_sequence_attention(cp):
    results = run_ranks(_cp_workers.attention_cases, cp, CASES, timeout_s=300)
    for index, (_, lengths) in enumerate(CASES):
        ref = dict(zip(("out", "dq", "dk", "dv"), library_reference_grads(*_cp_workers._qkv(index, sum(lengths)))))
        got = {name: torch.zeros_like(t) for name, t in ref.items()}
        whole = torch.zeros_like(ref["out"])
        for rank_results in results:
            r = rank_results[index]
            assert r["empty"] and r["kv_bytes"] > 0
            for name in got:
                got[name][:, r["rows"]] = r[name]
            whole[:, r["whole_rows"]] = r["whole_out"]
        for name in got:
            torch.testing.assert_close(got[name], ref[name], **TOL, msg=lambda m: f"{lengths} {name}: {m}")
        torch.testing.assert_close(whole, ref["out"], **TOL)
        # each rank cached 1/cp of every layer's K/V (k and v of [2, s, 2, 8] float64)
        assert results[0][index]["kv_bytes"] == 2 * 2 * sum(lengths) * 2 * 8 * 8 // cp
