"""SlimPipe slices of a CP-planned window (``plan/cp/slices.py``): every slice's tokens are held by
exactly the rank the engine planned them on, and the ranks' attention pieces together cover every
same-document, key-not-after-query pair of the window exactly once (checked against the mask
computed position by position)."""

import pytest

from megatron_slim.plan.cp.engines import plan_pack
from megatron_slim.plan.cp.slices import OWN, slice_pieces, slice_shares

from .conftest import topology

WINDOWS = [(7, 45, 20, 56), (100, 9, 13, 6), (30, 30, 68), (1,) * 8 + (120,), (128,)]


def _document_of(lengths):
    return [d for d, n in enumerate(lengths) for _ in range(n)]


def _coverage(shares, documents):
    """(query position, key position) -> times some rank's piece covers it, over every slice."""
    count: dict[tuple[int, int], int] = {}
    ranks = len(shares[0].runs)
    for j, share in enumerate(shares):
        query_positions = [p for r in range(ranks) for p in _positions(share, r)]
        for rank in range(ranks):
            key_rows = {i: _positions(s, rank) for i, s in enumerate(shares[: j + 1])}
            key_rows[OWN] = key_rows.pop(j)
            for piece in slice_pieces(shares, j, rank, documents):
                qs = query_positions[piece.q_first : piece.q_first + piece.q_rows]
                ks = key_rows[piece.source][piece.k_first : piece.k_first + piece.k_rows]
                if piece.documents is None:
                    pairs = [(q, k) for q in qs for k in ks]
                else:
                    assert qs == ks and sum(piece.documents) == len(qs)
                    pairs, at = [], 0
                    for n in piece.documents:
                        part = qs[at : at + n]
                        pairs += [(q, k) for i, q in enumerate(part) for k in part[: i + 1]]
                        at += n
                for pair in pairs:
                    count[pair] = count.get(pair, 0) + 1
    return count


def _positions(share, rank):
    """Window positions of the rank's rows; its padding row has none."""
    return [share.start + p for p in share.local_rows(rank)] if share.tokens(rank) else [None] * share.rows(rank)


@pytest.mark.parametrize("engine", ["zeppelin", "ring", "ulysses"])
@pytest.mark.parametrize("slices", [(64, 64), (32, 48, 48), (128,)])
def test_pieces_cover_each_document_causal_pair_once(engine, slices, costs):
    topo = topology("2x2")
    for lengths in WINDOWS:
        plan = plan_pack(engine, lengths, topo, costs)
        shares = slice_shares(plan, slices)
        for rank, layout in enumerate(plan.ranks):  # each rank holds exactly its planned tokens
            planned = sorted(s.pack_start + i for s in layout.segments for i in range(s.length))
            assert sorted(_window_positions(shares, rank)) == planned
        doc = _document_of(lengths)
        want = {(q, k): 1 for q in range(sum(lengths)) for k in range(q + 1) if doc[q] == doc[k]}
        got = _coverage(shares, lengths)
        assert {pair: n for pair, n in got.items() if None not in pair} == want, (engine, lengths, slices)


def _held(share, rank):
    return share.local_rows(rank)[: share.tokens(rank)]


def _window_positions(shares, rank):
    return [share.start + p for share in shares for p in _held(share, rank)]


def test_a_rank_without_tokens_in_a_slice_runs_one_padding_row(costs):
    plan = plan_pack("zeppelin", (1,) * 8 + (120,), topology("2x2"), costs)
    shares = slice_shares(plan, (8, 120))
    empty = [r for r in range(4) if shares[0].tokens(r) == 0]
    assert empty and all(shares[0].rows(r) == 1 for r in empty)
    assert shares[0].row_offsets() == tuple(sum(shares[0].rows(q) for q in range(r)) for r in range(4))


def test_slice_lengths_must_cover_the_window(costs):
    plan = plan_pack("ring", (64, 64), topology("2x2"), costs)
    with pytest.raises(ValueError, match="allowed: lengths summing to the planned window's 128 tokens"):
        slice_shares(plan, (64, 32))
