"""Causal attention of a block of queries against a block of keys, in one or two varlen calls.

Every engine (local, ring, all-to-all, all-gather) reduces to "these query spans against those key
spans", by positions inside each sequence. The rule, per query span ``Q`` and key span ``K`` of the
same sequence (spans are disjoint runs or the very same run):

* ``K`` ends at or before ``Q`` starts: every query sees every key (a *full* pair);
* ``K`` is ``Q`` itself (the rank's own block): the keys seen before ``Q`` plus ``Q``, with the
  library's bottom-right causal mask (a *causal* pair): row ``r`` sees all earlier keys and ``Q``'s
  first ``r + 1``;
* ``K`` starts at or after ``Q`` ends: nothing.

All full pairs of a block go into one non-causal varlen call and all causal pairs into one causal
call. Forward partials are folded into float32 accumulators with the library's ``merge``; the
backward, given the *final* output and log-sum-exp, gives each block's exact share of dQ/dK/dV.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_slim.runtime.attention import AttentionBackend, merge
from megatron_slim.runtime.cp.spans import Block, Span

Tensor = torch.Tensor


@dataclass(frozen=True, eq=False)
class Rows:
    """Rows of a buffer as ``(first, count)`` runs; one run is taken by slicing, more by index."""

    runs: tuple[tuple[int, int], ...]
    _index: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def of(cls, runs) -> "Rows":
        merged: list[tuple[int, int]] = []
        for first, n in runs:
            if n <= 0:
                continue
            if merged and merged[-1][0] + merged[-1][1] == first:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((first, n))
        return cls(tuple(merged))

    @property
    def count(self) -> int:
        return sum(n for _, n in self.runs)

    def index(self, device: torch.device) -> Tensor:
        key = str(device)
        if key not in self._index:
            self._index[key] = torch.tensor(
                [r for first, n in self.runs for r in range(first, first + n)], dtype=torch.long, device=device
            )
        return self._index[key]

    def take(self, x: Tensor, dim: int = 0) -> Tensor:
        if len(self.runs) == 1:
            first, n = self.runs[0]
            return x.narrow(dim, first, n)
        return x.index_select(dim, self.index(x.device))

    def put(self, target: Tensor, values: Tensor, dim: int = 0) -> None:
        if len(self.runs) == 1:
            target.narrow(dim, *self.runs[0]).copy_(values)
        else:
            target.index_copy_(dim, self.index(target.device), values.to(target.dtype))

    def add(self, target: Tensor, values: Tensor) -> None:
        """``target[rows] += values`` along dim 0; repeated rows accumulate."""
        if len(self.runs) == 1:
            target.narrow(0, *self.runs[0]).add_(values.to(target.dtype))
        else:
            target.index_add_(0, self.index(target.device), values.to(target.dtype))


@dataclass(frozen=True, eq=False)
class VarlenCall:
    causal: bool
    q: Rows
    k: Rows
    cu_q: tuple[int, ...]
    cu_k: tuple[int, ...]
    _cu: dict = field(default_factory=dict, repr=False, compare=False)

    def cu(self, device: torch.device) -> tuple[Tensor, Tensor]:
        key = str(device)
        if key not in self._cu:
            self._cu[key] = (
                torch.tensor(self.cu_q, dtype=torch.int32, device=device),
                torch.tensor(self.cu_k, dtype=torch.int32, device=device),
            )
        return self._cu[key]

    @property
    def max_q(self) -> int:
        return max(b - a for a, b in zip(self.cu_q, self.cu_q[1:]))

    @property
    def max_k(self) -> int:
        return max(b - a for a, b in zip(self.cu_k, self.cu_k[1:]))


def _call(causal: bool, entries: list[tuple[Span, list[Span]]]) -> VarlenCall | None:
    if not entries:
        return None
    cu_q, cu_k = [0], [0]
    q_runs: list[tuple[int, int]] = []
    k_runs: list[tuple[int, int]] = []
    for query, keys in entries:
        q_runs.append((query.row, query.length))
        k_runs.extend((k.row, k.length) for k in keys)
        cu_q.append(cu_q[-1] + query.length)
        cu_k.append(cu_k[-1] + sum(k.length for k in keys))
    return VarlenCall(causal, Rows.of(q_runs), Rows.of(k_runs), tuple(cu_q), tuple(cu_k))


def pair_calls(queries: Block, keys: Block, *, own: bool) -> tuple[VarlenCall, ...]:
    """The varlen calls of ``queries`` against ``keys``; ``own``: the keys are the queries' own
    tokens (the only case where a span may meet itself)."""
    by_seq: dict[int, list[Span]] = {}
    for k in keys:
        by_seq.setdefault(k.seq, []).append(k)
    causal, full = [], []
    for q in queries:
        before, same = [], None
        for k in by_seq.get(q.seq, ()):
            if k.end <= q.start:
                before.append(k)
            elif k.start >= q.end:
                continue
            elif own and (k.start, k.end) == (q.start, q.end):
                same = k
            else:
                raise ValueError(
                    f"sequence {q.seq}: query run {q.start}-{q.end} and key run {k.start}-{k.end} "
                    "overlap without being the same run: the plan's blocks are inconsistent"
                )
        if same is not None:
            causal.append((q, before + [same]))
        elif before:
            full.append((q, before))
    return tuple(c for c in (_call(True, causal), _call(False, full)) if c is not None)


def new_accumulators(rows: int, heads: int, head_dim: int, like: Tensor) -> tuple[Tensor, Tensor]:
    """float32 (or wider) output accumulator ``[rows, heads, d]`` and lse ``[heads, rows]`` = -inf."""
    acc = torch.promote_types(like.dtype, torch.float32)
    out = torch.zeros(rows, heads, head_dim, dtype=acc, device=like.device)
    lse = torch.full((heads, rows), float("-inf"), dtype=torch.float32, device=like.device)
    return out, lse


def forward_into(
    backend: AttentionBackend,
    scale: float,
    calls: tuple[VarlenCall, ...],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    acc_out: Tensor,
    acc_lse: Tensor,
) -> None:
    """Fold the attention of ``q`` against ``k``/``v`` (per ``calls``) into the accumulators."""
    for c in calls:
        cu_q, cu_k = c.cu(q.device)
        out, lse = backend.varlen_forward(
            c.q.take(q), c.k.take(k), c.k.take(v), cu_q, cu_k, c.max_q, c.max_k, causal=c.causal, softmax_scale=scale
        )
        merged_out, merged_lse = merge(c.q.take(acc_out), c.q.take(acc_lse, 1), out, lse)
        c.q.put(acc_out, merged_out)
        c.q.put(acc_lse, merged_lse, 1)


def backward_into(
    backend: AttentionBackend,
    scale: float,
    calls: tuple[VarlenCall, ...],
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    dq: Tensor,
    dk: Tensor,
    dv: Tensor,
) -> None:
    """Add this key block's share of the gradients: ``dq`` (query rows), ``dk``/``dv`` (key rows).
    ``out``/``lse`` are the final (merged over every key block) forward results."""
    for c in calls:
        cu_q, cu_k = c.cu(q.device)
        dq_c, dk_c, dv_c = backend.varlen_backward(
            c.q.take(dout).contiguous(),
            c.q.take(q),
            c.k.take(k),
            c.k.take(v),
            c.q.take(out),
            c.q.take(lse, 1).contiguous(),
            cu_q,
            cu_k,
            c.max_q,
            c.max_k,
            causal=c.causal,
            softmax_scale=scale,
        )
        c.q.add(dq, dq_c)
        c.k.add(dk, dk_c)
        c.k.add(dv, dv_c)
