"""Query-out CP slice attention (:mod:`cp_slice_attention`) over a packed window's documents.

Without documents every rank attends all the slice's queries to whole key blocks (its cached shards
non-causally, its own two chunks causally or fully). With documents a block is cut to what stays
inside one document, as :class:`Piece` values in slice-query rows and local key rows:

* a key range wholly before a query range can only be seen by the document holding the range's
  first query, and only through that document's keys in the range: one dense non-causal piece
  (or none, if that document starts after the keys end);
* a rank's own chunk against its own rows is causal per document: one varlen piece whose sequences
  are the chunk's document pieces (queries equal keys).

Query rows that no piece of this rank covers keep lse = -inf; the log-sum-exp merge over the CP
ranks gives each row its own document's keys, since every row sees itself on the rank holding it.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from itertools import accumulate
from typing import Optional

import torch

from megatron_slim.runtime.attention import AttentionBackend, merge_
from megatron_slim.runtime.pipeline.zigzag import ZigzagLayout

Tensor = torch.Tensor
OWN = -1  # a piece's keys are this slice's own local K/V (else: index of a cached prefix shard)


@dataclass(frozen=True)
class Piece:
    q_first: int  # query rows in the slice's position order
    q_rows: int
    source: int  # OWN or a cached prefix shard
    k_first: int  # rows of the source's local K/V
    k_rows: int
    documents: Optional[tuple[int, ...]] = None  # a causal diagonal cut into documents (varlen, q == k)


@dataclass(frozen=True)
class _Window:
    lengths: tuple[int, ...]
    starts: tuple[int, ...]

    @staticmethod
    def of(lengths: tuple[int, ...]) -> "_Window":
        return _Window(lengths, tuple([0, *accumulate(lengths)][:-1]))

    def document_of(self, position: int) -> tuple[int, int]:
        d = bisect_right(self.starts, position) - 1
        return self.starts[d], self.starts[d] + self.lengths[d]

    def cut(self, lo: int, hi: int) -> tuple[int, ...]:
        """Lengths of the documents' parts inside ``[lo, hi)``."""
        parts, at = [], lo
        while at < hi:
            end = min(self.document_of(at)[1], hi)
            parts.append(end - at)
            at = end
        return tuple(parts)


def _before(w: _Window, q: tuple[int, int], k: tuple[int, int], start: int, source: int, k_base: int):
    """The piece of keys ``k`` (global, wholly before queries ``q``) that the queries may see."""
    doc_start, doc_end = w.document_of(q[0])
    if doc_start >= k[1]:
        return None
    k_lo = max(k[0], doc_start)
    q_hi = min(doc_end, q[1])
    return Piece(q[0] - start, q_hi - q[0], source, k_base + k_lo - k[0], k[1] - k_lo)


def document_pieces(
    layout: ZigzagLayout, rank: int, start: int, prefix_lengths: list[int], lengths: tuple[int, ...]
) -> list[Piece]:
    """This rank's pieces for the slice at ``start`` (window position) after cached slices of
    ``prefix_lengths`` tokens, in a window of documents ``lengths``."""
    w, pieces = _Window.of(lengths), []
    queries = (start, start + layout.length)
    prefix_start = 0
    for i, n in enumerate(prefix_lengths):
        shard = ZigzagLayout(layout.cp, n)
        for t, p in enumerate(shard.own_chunks(rank)):
            keys = (prefix_start + p * shard.chunk, prefix_start + (p + 1) * shard.chunk)
            pieces.append(_before(w, queries, keys, start, i, t * shard.chunk))
        prefix_start += n
    c = layout.chunk
    for t, p in enumerate(layout.own_chunks(rank)):
        lo, hi = start + p * c, start + (p + 1) * c
        pieces.append(Piece(p * c, c, OWN, t * c, c, documents=w.cut(lo, hi)))
        if hi < queries[1]:
            pieces.append(_before(w, (hi, queries[1]), (lo, hi), start, OWN, t * c))
    return [piece for piece in pieces if piece is not None]


def _rows(x: Tensor, first: int, n: int, dim: int = 1) -> Tensor:
    return x.narrow(dim, first, n)


def _cu(lengths: tuple[int, ...], device: torch.device) -> Tensor:
    return torch.tensor([0, *accumulate(lengths)], dtype=torch.int32, device=device)


def pieces_forward(backend: AttentionBackend, scale: float, q: Tensor, keys: dict, pieces: list[Piece], out, lse):
    """Fold every piece's partial into ``out [1, L, hq, d]`` / ``lse [1, hq, L]`` (fp32, in place);
    ``keys``: source -> (k, v) local tensors."""
    for piece in pieces:
        k, v = (_rows(x, piece.k_first, piece.k_rows) for x in keys[piece.source])
        qp = _rows(q, piece.q_first, piece.q_rows)
        if piece.documents is None:
            o, o_lse = backend.forward(qp, k, v, causal=False, softmax_scale=scale)
        else:
            cu, most = _cu(piece.documents, q.device), max(piece.documents)
            o, o_lse = backend.varlen_forward(qp[0], k[0], v[0], cu, cu, most, most, causal=True, softmax_scale=scale)
            o, o_lse = o.unsqueeze(0), o_lse.unsqueeze(0)
        merge_(_rows(out, piece.q_first, piece.q_rows), _rows(lse, piece.q_first, piece.q_rows, dim=2), o, o_lse)


def pieces_backward(backend: AttentionBackend, scale: float, q, dout, out, lse, keys: dict, pieces: list[Piece]):
    """(dq fp32 of all the slice's queries, source -> (dk, dv) fp32) from the global ``out``/``lse``."""
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    grads = {
        src: tuple(torch.zeros(x.shape, dtype=torch.float32, device=x.device) for x in kv) for src, kv in keys.items()
    }
    for piece in pieces:
        k, v = (_rows(x, piece.k_first, piece.k_rows).contiguous() for x in keys[piece.source])
        qp, dop, op = (_rows(x, piece.q_first, piece.q_rows).contiguous() for x in (q, dout, out))
        lp = _rows(lse, piece.q_first, piece.q_rows, dim=2).contiguous()
        if piece.documents is None:
            dq_p, dk_p, dv_p = backend.backward(dop, qp, k, v, op, lp, causal=False, softmax_scale=scale)
        else:
            cu, most = _cu(piece.documents, q.device), max(piece.documents)
            dq_p, dk_p, dv_p = (
                x.unsqueeze(0)
                for x in backend.varlen_backward(
                    dop[0], qp[0], k[0], v[0], op[0], lp[0], cu, cu, most, most, causal=True, softmax_scale=scale
                )
            )
        _rows(dq, piece.q_first, piece.q_rows).add_(dq_p)
        dk, dv = grads[piece.source]
        _rows(dk, piece.k_first, piece.k_rows).add_(dk_p)
        _rows(dv, piece.k_first, piece.k_rows).add_(dv_p)
    return dq, grads
