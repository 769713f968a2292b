"""The input embedding on every pipeline rank (``schedule.vocab_parallel``), exactly.

The word embedding is sharded by vocabulary over the pipeline ranks (the paper's design): rank
``r`` looks up only the ids of its vocabulary shard (``VocabHead.rows_of(r)``) in its rows
(``VocabHead.lookup_head.shard()``: the first stage's whole word embedding or, tied, the output
weight's copy, read as a view; untied replicas hold only their shard's rows). Stage 0's word
embedding module hands each slice's input ids to ``EmbeddingExchange.lookup``: it sends the ids to
every rank, each returns its partial rows (its shard's tokens' rows, zeros elsewhere) and stage 0
sums its own and the returned partial rows. Every other rank serves a slice where
``plan/schedule/vocab.py`` places its ``EmbeddingJoin`` (at the latest right before it receives the
slice's forward input on its first chunk; ``plan/schedule/vocab_cuts.py``: where, and why no rank
waits forever).

Backward: stage 0's backward of a slice keeps the rows' gradient; its next lookup hands it to
every rank before its ids (those of the backwards after its last forward go when the rows end),
and each rank back-propagates it into its shard's rows (an embedding backward: rows accumulate
their tokens' gradients; other tokens add zero). ``VocabHead.reduce_grads`` then gives the owner the
whole gradient.

Under tensor parallelism each TP rank's pipeline group does all of this over that TP rank's
vocabulary shard (``VocabHead.offset``), and stage 0 sums its TP ranks' rows (as Megatron's
``VocabParallelEmbedding`` all-reduces them); the gradient of the sum is the same on every TP rank.

Exact: every token's row is looked up by one rank, with the same weight values; the sum adds
exact zeros from the others, and each row's gradient sums the same contributions (only their
order of addition differs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_slim.plan.schedule.vocab import EmbeddingJoin
from megatron_slim.runtime.pipeline.vocab_weights import VocabHead, receive

_IDS, _ROWS, _GRAD = range(3)
Key = tuple[int, int]  # (microbatch, slice)


class _SummedParts(torch.autograd.Function):
    """The ranks' partial rows summed (over ``tp_group`` too, if any); backward hands the rows'
    gradient to ``keep`` for the others."""

    @staticmethod
    def forward(ctx, keep, tp_group, local, *remote):
        ctx.keep = keep
        rows = sum(remote, local.clone())
        if tp_group is not None:
            dist.all_reduce(rows, group=tp_group)
        return rows

    @staticmethod
    def backward(ctx, grad):
        ctx.keep(grad.contiguous())
        return (None, None, grad, *(None for _ in range(len(ctx.needs_input_grad) - 3)))


def shard_lookup(head: VocabHead, ids: torch.Tensor) -> torch.Tensor:
    """The rows of ``ids`` in this rank's vocabulary shard; zero rows for the other ids."""
    lo, hi = head.ids_of(head.index)
    mine = (ids >= lo) & (ids < hi)
    rows = F.embedding((ids - lo).clamp(0, hi - lo - 1), head.shard())
    return rows * mine.unsqueeze(-1).to(rows.dtype)


@dataclass
class EmbeddingExchange:
    """One schedule call's embedding lookups on this rank (stage 0 or a serving rank)."""

    head: VocabHead  # this rank's copy of the word embedding
    rank: int  # pipeline rank
    tail: tuple[Key, ...]  # gradients handed over after the row
    slice_lengths: Sequence[int]
    micro_batch: int
    hidden_size: int
    num_microbatches: int
    tag_base: int  # above every tag the schedule and the output exchange use
    forward_only: bool = False
    rows: Optional[Callable[[int, int], int]] = None  # (microbatch, slice) -> rows, if not the slice length
    ids: dict = field(default_factory=dict)  # key -> the slice's ids, until its gradient comes (rank > 0)
    outgoing: dict = field(default_factory=dict)  # key -> the rows' gradient, until handed over (stage 0)
    _join: Optional[EmbeddingJoin] = None  # the join of stage 0's forward now running

    @property
    def _ranks(self) -> Sequence[int]:
        return self.head.pp_ranks

    def _tag(self, kind: int, key: Key) -> int:
        n = len(self.slice_lengths)
        return (self.tag_base + (kind * self.num_microbatches + key[0]) * n + key[1]) % (2**31 - 1)

    def is_drained(self) -> bool:
        return not self.ids and not self.outgoing

    def meet(self, join: EmbeddingJoin) -> None:
        """Where this rank's row meets ``join`` (``plan/schedule/vocab.py``'s ``vocab_joins``)."""
        if self.rank == 0:
            self._join = join  # met inside the forward, by ``lookup``
        else:
            self._serve(join)

    def finish(self) -> None:
        """After the row: the gradients of the backwards stage 0 ran after its last forward."""
        if self.rank == 0:
            for work in self._hand_grads(self.tail):
                work.wait()
        else:
            for key in self.tail:
                self._take_grad(key)

    def lookup(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Stage 0: the word embedding rows ``[b, s, h]`` of a slice's ids ``[b, s]``."""
        join, self._join = self._join, None
        if join is None:
            raise RuntimeError("schedule.vocab_parallel: a word embedding lookup outside stage 0's planned forwards")
        works = self._hand_grads(join.grads)
        ids = input_ids.long().contiguous()
        for r in range(1, self.head.size):
            works.append(dist.isend(ids, self._ranks[r], self.head.group, self._tag(_IDS, join.lookup)))
        local = shard_lookup(self.head, ids)
        remote = []
        for r in range(1, self.head.size):
            rows = torch.empty(*ids.shape, self.hidden_size, dtype=self.head.weight.dtype)
            receive(rows, self._ranks[r], self.head.group, self._tag(_ROWS, join.lookup))
            remote.append(rows)
        for work in works:
            work.wait()
        tp_group = self.head.tp_group
        if self.forward_only or (self.head.size == 1 and tp_group is None):
            return _SummedParts.apply(None, tp_group, local, *remote) if tp_group is not None else sum(remote, local)
        keep = (lambda grad: None) if self.head.size == 1 else self._keep(join.lookup)
        return _SummedParts.apply(keep, tp_group, local, *remote)

    def _keep(self, key: Key) -> Callable[[torch.Tensor], None]:
        return lambda grad: self.outgoing.__setitem__(key, grad)

    def _hand_grads(self, keys: Sequence[Key]) -> list:
        works = []
        for key in keys if not self.forward_only and self.head.size > 1 else ():
            if key not in self.outgoing:
                raise RuntimeError(f"schedule.vocab_parallel: no embedding gradient of slice {key} to hand over")
            grad = self.outgoing.pop(key)
            for r in range(1, self.head.size):
                works.append(dist.isend(grad, self._ranks[r], self.head.group, self._tag(_GRAD, key)))
        return works

    def _length(self, key: Key) -> int:
        return self.rows(*key) if self.rows is not None else self.slice_lengths[key[1]]

    def _serve(self, join: EmbeddingJoin) -> None:
        """A rank other than stage 0: take earlier gradients, then look up its shard's rows of the slice."""
        for key in join.grads if not self.forward_only else ():
            self._take_grad(key)
        ids = torch.empty(self.micro_batch, self._length(join.lookup), dtype=torch.int64)
        receive(ids, self._ranks[0], self.head.group, self._tag(_IDS, join.lookup))
        with torch.no_grad():
            rows = shard_lookup(self.head, ids)
        if not self.forward_only:
            self.ids[join.lookup] = ids
        dist.send(rows, self._ranks[0], self.head.group, self._tag(_ROWS, join.lookup))  # stage 0 is receiving

    def _take_grad(self, key: Key) -> None:
        ids = self.ids.pop(key)
        grad = torch.empty(*ids.shape, self.hidden_size, dtype=self.head.weight.dtype)
        receive(grad, self._ranks[0], self.head.group, self._tag(_GRAD, key))
        with torch.enable_grad():
            shard_lookup(self.head, ids).backward(grad)
