"""The output layer and loss on every pipeline rank (``schedule.vocab_parallel``), exactly.

Each pipeline rank holds a copy of the output weight (``VocabHead``): the last stage's own
``output_layer.weight``, the first stage's word embedding when input and output are tied, a
replica elsewhere. The last stage's model chunk returns its final (normed) hidden states instead
of the loss. At one point of each rank's row per microbatch (``plan/schedule/vocab.py`` says
where and why no rank can wait forever) every rank joins ``VocabExchange.join``:

1. the last rank cuts each slice's hidden states, labels and loss mask into ``pp`` parts along
   the sequence and sends part ``r`` to pipeline rank ``r`` (it keeps the last part);
2. the microbatch's loss-token count is all-reduced over the pipeline group (Megatron divides a
   microbatch's loss sum by it and by the number of microbatches);
3. slice by slice, each rank computes logits and cross entropy of its part (fp32), scales its loss
   sum as Megatron scales the microbatch's, and back-propagates it at once into its copy of the
   output weight and into the part's hidden states; only one part's logits live at a time;
4. the hidden-state gradients go back to the last rank, which joins them as the output gradient
   its backward of each slice starts from; the loss sum and count are all-reduced for the report.

Messages are tagged above the schedule's own tags, so gloo never matches one for the other. After
the step ``VocabHead.reduce_grads`` sums the copies' gradients over the pipeline group (as Megatron
sums tied embedding copies), so the optimizer-owned copies step with the whole gradient;
``VocabHead.refresh`` copies the last stage's weight into the replicas before each step's forward
and clears their gradients.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

_HIDDEN, _LABELS, _MASK, _GRAD = range(4)


@dataclass
class VocabHead:
    """This pipeline rank's copy of the output weight, and the pipeline group it is shared over."""

    weight: torch.nn.Parameter
    owned: bool  # stepped by this rank's optimizer (else a replica, refreshed from the source rank)
    group: Optional[dist.ProcessGroup]
    pp_ranks: Sequence[int]  # global rank of each pipeline rank
    source: int = -1  # the pipeline rank whose optimizer-owned copy replicas take
    embedding: Optional["VocabHead"] = None  # untied: the word embedding's copies (tied: this weight)

    @property
    def size(self) -> int:
        return len(self.pp_ranks)

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
        buffer = self.weight.data if dist.get_rank() == src or not self.owned else torch.empty_like(self.weight.data)
        dist.broadcast(buffer, src=src, group=self.group)

    def reduce_grads(self) -> None:
        """Every copy gets the sum of all copies' gradients (the whole weight's gradient)."""
        if self.embedding is not None:
            self.embedding.reduce_grads()
        if self.size == 1:
            return
        if self.weight.grad is None:
            self.weight.grad = torch.zeros_like(self.weight)
        dist.all_reduce(self.weight.grad, group=self.group)


@dataclass
class VocabExchange:
    """One schedule call's exchanges: what the last rank keeps until them, what they hand back."""

    head: VocabHead
    rank: int  # pipeline rank
    slice_lengths: Sequence[int]
    micro_batch: int
    hidden_size: int
    num_microbatches: int
    tag_base: int  # above every tag the schedule's own messages use
    forward_only: bool = False
    embedding: Optional[Any] = None  # the call's EmbeddingExchange (runtime/pipeline/vocab_embedding.py)
    kept: dict = field(default_factory=dict)  # (mb, slice) -> (hidden, labels, loss_mask), last rank
    grads: dict = field(default_factory=dict)  # (mb, slice) -> hidden-state gradient, last rank
    reports: list = field(default_factory=list)  # per microbatch, on the last rank

    @property
    def last(self) -> bool:
        return self.rank == self.head.size - 1

    def keep(self, microbatch: int, slice_: int, hidden: torch.Tensor, targets: tuple) -> None:
        """The last stage's forward of a slice: its hidden states and ``(labels, loss_mask)``."""
        labels, loss_mask = targets
        self.kept[(microbatch, slice_)] = (hidden.detach(), labels, loss_mask)

    def hidden_grad(self, microbatch: int, slice_: int) -> torch.Tensor:
        return self.grads.pop((microbatch, slice_))

    def is_drained(self) -> bool:
        return not self.kept and not self.grads

    def _tag(self, kind: int, microbatch: int, slice_: int) -> int:
        n = len(self.slice_lengths)
        return (self.tag_base + (kind * self.num_microbatches + microbatch) * n + slice_) % (2**31 - 1)

    def _scatter(self, microbatch: int, pending: list) -> list:
        """Step 1: this rank's (hidden, labels, loss_mask) part of each slice."""
        p, group, ranks = self.head.size, self.head.group, self.head.pp_ranks
        mine = []
        for j in range(len(self.slice_lengths)):
            if self.last:
                hidden, labels, mask = self.kept.pop((microbatch, j))
                cuts = zip(
                    torch.tensor_split(hidden, p, 0), torch.tensor_split(labels, p, 1), torch.tensor_split(mask, p, 1)
                )
                for r, part in enumerate(cuts):
                    if r == self.rank:
                        mine.append(part)
                        continue
                    for kind, t in zip((_HIDDEN, _LABELS, _MASK), part):
                        work = dist.isend(t.contiguous(), self.head.pp_ranks[r], group, self._tag(kind, microbatch, j))
                        pending.append(work)
            else:
                lo, hi = bounds_of(self.slice_lengths[j], p, self.rank)
                b, h = self.micro_batch, self.hidden_size
                bufs = (
                    torch.empty(hi - lo, b, h, dtype=self.head.weight.dtype),
                    torch.empty(b, hi - lo, dtype=torch.int64),
                    torch.empty(b, hi - lo, dtype=torch.float32),
                )
                for kind, t in zip((_HIDDEN, _LABELS, _MASK), bufs):
                    receive(t, ranks[-1], group, self._tag(kind, microbatch, j))
                mine.append(bufs)
        return mine

    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.head.size > 1:
            dist.all_reduce(t, group=self.head.group)
        return t

    def join(self, microbatch: int) -> None:
        """Steps 1 to 4 for ``microbatch`` (see the module doc); every pipeline rank calls it."""
        pending: list = []
        parts = self._scatter(microbatch, pending)
        mask_dtype = parts[0][2].dtype if parts else torch.float32
        count = self._all_reduce(sum((m.sum() for _, _, m in parts), torch.zeros((), dtype=mask_dtype)).float())
        scale = 1.0 / (torch.clamp(count, min=1) * self.num_microbatches)
        loss_sum = torch.zeros(())
        my_grads = []
        for hidden, labels, mask in parts:
            part = hidden.detach().requires_grad_(not self.forward_only)
            with torch.set_grad_enabled(not self.forward_only):
                logits = F.linear(part, self.head.weight).float()  # [tokens, b, vocab]
                losses = F.cross_entropy(logits.flatten(0, 1), labels.t().reshape(-1), reduction="none")
                loss = torch.sum(losses * mask.t().reshape(-1).to(losses.dtype))
            if not self.forward_only:
                (loss * scale).backward()
                my_grads.append(part.grad)
            loss_sum += loss.detach()
        self._gather_grads(microbatch, my_grads, pending)
        for work in pending:
            work.wait()
        loss_sum = self._all_reduce(loss_sum)  # the count is already the pipeline group's
        if self.last:
            self.reports.append({"lm loss": torch.stack([loss_sum, count])})

    def _gather_grads(self, microbatch: int, my_grads: list, pending: list) -> None:
        """Step 4: the hidden-state gradients of every part, joined on the last rank."""
        if self.forward_only:
            return
        p, group, ranks = self.head.size, self.head.group, self.head.pp_ranks
        for j, grad in enumerate(my_grads):
            if not self.last:
                pending.append(dist.isend(grad.contiguous(), ranks[-1], group, self._tag(_GRAD, microbatch, j)))
                continue
            parts = []
            for r in range(p - 1):
                lo, hi = bounds_of(self.slice_lengths[j], p, r)
                buf = torch.empty(hi - lo, *grad.shape[1:], dtype=grad.dtype)
                receive(buf, ranks[r], group, self._tag(_GRAD, microbatch, j))
                parts.append(buf)
            self.grads[(microbatch, j)] = torch.cat([*parts, grad], 0)


def receive(buffer: torch.Tensor, src: int, group: Optional[dist.ProcessGroup], tag: int) -> None:
    work = dist.irecv(buffer, src, group, tag)
    assert work is not None  # None only for a rank outside the group
    work.wait()


def bounds_of(length: int, parts: int, index: int) -> tuple[int, int]:
    """Part ``index`` of ``length`` tokens cut into ``parts`` as ``torch.tensor_split`` cuts them."""
    base, extra = divmod(length, parts)
    lo = index * base + min(index, extra)
    return lo, lo + base + (1 if index < extra else 0)
