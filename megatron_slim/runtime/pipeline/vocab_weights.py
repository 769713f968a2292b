"""Each pipeline rank's copy of a vocabulary weight under ``schedule.vocab_parallel``.

A weight has one or two optimizer-owned copies (the last stage's output layer, the first stage's
word embedding; both when they are tied), which hold the whole weight so that the optimizer and
checkpoints see the usual parameters. Other ranks hold replicas outside the optimizer: the whole
weight, or (``sharded``) only the rows of this rank's vocabulary shard, which is all the
vocabulary-parallel cross entropy (``runtime/pipeline/vocab.py``) and the sharded lookup
(``runtime/pipeline/vocab_embedding.py``) read. Replicas take the owners'
values before every step (``refresh``); after it, the owners get the sum of every copy's gradient
(``reduce_grads``).

Under tensor parallelism every copy is of this TP rank's vocabulary shard (Megatron's
``VocabParallelEmbedding`` / ``ColumnParallelLinear`` rows, from ``offset``): the pipeline group
(the same TP rank of every stage) shares it as above, and the loss and lookups sum over
``tp_group`` the shards the TP ranks' pipeline groups computed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

_SHARD_TAG = 2**30  # between steps no other message is in flight; apart from the schedule's anyway


@dataclass
class VocabHead:
    """This pipeline rank's copy of a vocabulary weight, and the pipeline group it is shared over."""

    weight: torch.nn.Parameter
    owned: bool  # stepped by this rank's optimizer (else a replica, refreshed from the source rank)
    group: Optional[dist.ProcessGroup]
    pp_ranks: Sequence[int]  # global rank of each pipeline rank
    source: int = -1  # the pipeline rank whose optimizer-owned copy replicas take
    embedding: Optional["VocabHead"] = None  # untied: the word embedding's copies (tied: this weight)
    vocab_size: int = 0  # rows of the whole weight; with ``sharded``, required
    sharded: bool = False  # replicas hold only their shard's rows (owned copies stay whole)
    cp_group: Optional[dist.ProcessGroup] = None  # context parallelism: the loss tokens are counted over it
    offset: int = 0  # the vocabulary id of the whole weight's first row (this TP rank's first)
    tp_group: Optional[dist.ProcessGroup] = None  # tensor parallelism: the other TP ranks' vocabulary shards

    @property
    def size(self) -> int:
        return len(self.pp_ranks)

    @property
    def index(self) -> int:
        """This rank's place in the pipeline group."""
        return list(self.pp_ranks).index(dist.get_rank()) if self.size > 1 else 0

    def rows_of(self, index: int) -> tuple[int, int]:
        """``[lo, hi)``: the vocabulary rows of pipeline rank ``index``'s shard."""
        return bounds_of(self.vocab_size or self.weight.shape[0], self.size, index)

    def ids_of(self, index: int) -> tuple[int, int]:
        """``[lo, hi)``: the vocabulary ids of pipeline rank ``index``'s shard (its rows from ``offset``)."""
        lo, hi = self.rows_of(index)
        return self.offset + lo, self.offset + hi

    def shard(self) -> torch.Tensor:
        """This rank's rows of the weight (a view of a whole copy)."""
        if self.sharded and not self.owned:
            return self.weight
        lo, hi = self.rows_of(self.index)
        return self.weight[lo:hi]

    @property
    def lookup_head(self) -> "VocabHead":
        """The copies input embeddings are looked up in (``runtime/pipeline/vocab_embedding.py``)."""
        return self.embedding if self.embedding is not None else self

    def refresh(self) -> None:
        """Replicas take the source rank's weight (optimizer-owned copies already hold it) and drop
        the previous step's gradient (no optimizer zeroes it)."""
        if self.embedding is not None:
            self.embedding.refresh()
        if not self.owned:
            self.weight.grad = None
        if self.size == 1:
            return
        src = self.pp_ranks[self.source]
        if self.sharded:
            self._scatter_rows(src)
            return
        buffer = self.weight.data if dist.get_rank() == src or not self.owned else torch.empty_like(self.weight.data)
        dist.broadcast(buffer, src=src, group=self.group)

    def _scatter_rows(self, src: int) -> None:
        if dist.get_rank() != src:
            receive(self.weight.data, src, self.group, _SHARD_TAG)
            return
        for r, rank in enumerate(self.pp_ranks):
            if rank != src:
                lo, hi = self.rows_of(r)
                dist.send(self.weight.data[lo:hi].contiguous(), rank, self.group, _SHARD_TAG)

    def reduce_grads(self, sum_owned_copies: bool = True) -> None:
        """Every whole copy gets the sum of all copies' gradients (the whole weight's gradient).

        ``sum_owned_copies=False`` (tied, under Megatron-LM's loop): Megatron's
        ``finalize_model_grads`` sums the first and last stages' owned copies over its embedding group
        afterwards, so the first stage keeps its own gradient out of the sum here."""
        if self.embedding is not None:
            self.embedding.reduce_grads()
        if self.size == 1:
            return
        grad = self._grad()
        if not self.sharded:
            keep_own = not sum_owned_copies and self.owned and self.index != self.source % self.size
            own = grad.clone() if keep_own else None
            if own is not None:
                grad.zero_()
            dist.all_reduce(grad, group=self.group)
            if own is not None:
                grad.copy_(own)
            return
        src = self.pp_ranks[self.source]
        if dist.get_rank() != src:
            dist.send(grad, src, self.group, _SHARD_TAG)
            return
        for r, rank in enumerate(self.pp_ranks):
            if rank != src:
                lo, hi = self.rows_of(r)
                rows = torch.empty_like(grad[lo:hi])
                receive(rows, rank, self.group, _SHARD_TAG)
                grad[lo:hi] += rows

    def _grad(self) -> torch.Tensor:
        """Where this copy's gradient accumulates: Megatron-LM's DDP moves an optimizer-owned
        parameter's gradient into ``main_grad`` as backward produces it."""
        main = getattr(self.weight, "main_grad", None)
        if self.owned and main is not None:
            return main
        if self.weight.grad is None:
            self.weight.grad = torch.zeros_like(self.weight)
        return self.weight.grad


def receive(buffer: torch.Tensor, src: int, group: Optional[dist.ProcessGroup], tag: int) -> None:
    work = dist.irecv(buffer, src, group, tag)
    assert work is not None  # None only for a rank outside the group
    work.wait()


def bounds_of(length: int, parts: int, index: int) -> tuple[int, int]:
    """Part ``index`` of ``length`` items cut into ``parts`` as ``torch.tensor_split`` cuts them."""
    base, extra = divmod(length, parts)
    lo = index * base + min(index, extra)
    return lo, lo + base + (1 if index < extra else 0)
