"""The input embedding on every pipeline rank (``schedule.vocab_parallel``), exactly.

Each pipeline rank holds a copy of the word embedding (``VocabHead.lookup_head``: the output
weight's copy when input and output are tied, else the first stage's word embedding and replicas).
Stage 0's word embedding module hands each slice's input ids to ``EmbeddingExchange.lookup``: the
ids are cut into ``pp`` parts along the sequence, part ``r`` goes to pipeline rank ``r``, which looks
it up with its copy and sends the rows back; stage 0 looks up part 0 itself and joins the parts
along the sequence. Every other rank serves a slice where ``plan/schedule/vocab.py`` places its
``EmbeddingJoin`` (at the latest right before it receives the slice's forward input on its first
chunk; ``plan/schedule/vocab_cuts.py``: where, and why no rank waits forever).

Backward: stage 0's backward of a slice keeps the gradient of each remote part; its next lookup
hands them to their ranks before its ids (the rest go after the row ends), and each rank
back-propagates its part into its copy (an embedding backward: rows accumulate their tokens'
gradients). ``VocabHead.reduce_grads`` then sums the copies over the pipeline group.

Exact: every token's row is looked up once, with the same weight values, and the parts are
joined, never summed; only the order in which a row's gradient contributions add differs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_slim.plan.schedule.vocab import EmbeddingJoin
from megatron_slim.runtime.pipeline.vocab_weights import VocabHead, bounds_of, receive

_IDS, _ROWS, _GRAD = range(3)
Key = tuple[int, int]  # (microbatch, slice)


class _JoinedParts(torch.autograd.Function):
    """The parts' rows joined along the sequence; backward hands the remote parts' gradients to ``keep``."""

    @staticmethod
    def forward(ctx, keep, local, *remote):
        ctx.keep, ctx.lengths = keep, [local.shape[1], *(t.shape[1] for t in remote)]
        return torch.cat([local, *remote], 1)

    @staticmethod
    def backward(ctx, grad):
        parts = torch.split(grad, ctx.lengths, 1)
        ctx.keep([p.contiguous() for p in parts[1:]])
        return (None, parts[0], *(None for _ in parts[1:]))


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
    ids: dict = field(default_factory=dict)  # key -> this rank's ids part, until its gradient comes (rank > 0)
    outgoing: dict = field(default_factory=dict)  # key -> remote parts' gradients, until handed over (stage 0)
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
        parts = torch.tensor_split(input_ids.long(), self.head.size, 1)
        for r in range(1, self.head.size):
            works.append(
                dist.isend(parts[r].contiguous(), self._ranks[r], self.head.group, self._tag(_IDS, join.lookup))
            )
        local = F.embedding(parts[0], self.head.weight)
        remote = []
        for r in range(1, self.head.size):
            rows = torch.empty(*parts[r].shape, self.hidden_size, dtype=self.head.weight.dtype)
            receive(rows, self._ranks[r], self.head.group, self._tag(_ROWS, join.lookup))
            remote.append(rows)
        for work in works:
            work.wait()
        if self.forward_only or self.head.size == 1:
            return torch.cat([local, *remote], 1)
        return _JoinedParts.apply(lambda grads: self.outgoing.__setitem__(join.lookup, grads), local, *remote)

    def _hand_grads(self, keys: Sequence[Key]) -> list:
        works = []
        for key in keys if not self.forward_only and self.head.size > 1 else ():
            if key not in self.outgoing:
                raise RuntimeError(f"schedule.vocab_parallel: no embedding gradient of slice {key} to hand over")
            for r, grad in enumerate(self.outgoing.pop(key), start=1):
                works.append(dist.isend(grad, self._ranks[r], self.head.group, self._tag(_GRAD, key)))
        return works

    def _part_length(self, key: Key) -> int:
        length = self.rows(*key) if self.rows is not None else self.slice_lengths[key[1]]
        lo, hi = bounds_of(length, self.head.size, self.rank)
        return hi - lo

    def _serve(self, join: EmbeddingJoin) -> None:
        """A rank other than stage 0: take earlier gradients, then look up its part of the slice."""
        for key in join.grads if not self.forward_only else ():
            self._take_grad(key)
        ids = torch.empty(self.micro_batch, self._part_length(join.lookup), dtype=torch.int64)
        receive(ids, self._ranks[0], self.head.group, self._tag(_IDS, join.lookup))
        with torch.no_grad():
            rows = F.embedding(ids, self.head.weight)
        if not self.forward_only:
            self.ids[join.lookup] = ids
        dist.send(rows, self._ranks[0], self.head.group, self._tag(_ROWS, join.lookup))  # stage 0 is receiving

    def _take_grad(self, key: Key) -> None:
        ids = self.ids.pop(key)
        grad = torch.empty(*ids.shape, self.hidden_size, dtype=self.head.weight.dtype)
        receive(grad, self._ranks[0], self.head.group, self._tag(_GRAD, key))
        with torch.enable_grad():
            F.embedding(ids, self.head.weight).backward(grad)
