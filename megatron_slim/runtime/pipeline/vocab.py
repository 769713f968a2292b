"""The output layer and loss on every pipeline rank (``schedule.vocab_parallel``), exactly.

Each pipeline rank computes the logits of its vocabulary shard (``VocabHead.shard``: rows of the
last stage's ``output_layer.weight``, of the first stage's word embedding when input and output
are tied, or of a replica; ``runtime/pipeline/vocab_weights.py``). The last stage's model chunk
returns its final (normed) hidden states instead of the loss. At one point of each rank's row per
microbatch (``plan/schedule/vocab.py`` says where and why no rank can wait forever) every rank
joins ``VocabExchange.join``:

1. the last rank sends each slice's hidden states, labels and loss mask to every rank;
2. every rank counts the microbatch's loss tokens (Megatron divides a microbatch's loss sum by
   them and by the number of microbatches); under context parallelism each CP rank runs its own
   exchanges within its pipeline group on its share of the sequence (rows as the CP plan lays
   them out, ``rows``; its labels are cut alike), counts the tokens over the CP group and scales
   its loss by the CP size, as ``megatron.cp.data.cp_loss_func`` does (gradients are then
   averaged over the CP ranks);
3. slice by slice, each rank computes its shard's logits (fp32) and the vocabulary-parallel cross
   entropy (``vocab_parallel_cross_entropy``: the max, the sum of exponentials and the target
   logit all-reduced over the pipeline group), and back-propagates its shard's part of the scaled
   loss at once into its rows and into the hidden states; only one slice's logits live at a time;
4. the hidden-state gradients are summed on the last rank, as the output gradient its backward of
   each slice starts from; the last rank reports the loss sum and count.

Messages are tagged above the schedule's own tags, so gloo never matches one for the other. After
the step ``VocabHead.reduce_grads`` gives the optimizer-owned copies the whole gradient;
``VocabHead.refresh`` copies the owners' rows into the replicas before each step's forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_slim.runtime.pipeline.vocab_weights import VocabHead, receive

_HIDDEN, _LABELS, _MASK, _GRAD = range(4)


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
    rows: Optional[Callable[[int, int], int]] = None  # (microbatch, slice) -> rows, if not the slice length
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

    def _hand_out(self, microbatch: int, pending: list) -> list:
        """Step 1: every slice's (hidden, labels, loss_mask), on every rank."""
        group, ranks = self.head.group, self.head.pp_ranks
        slices = []
        for j, length in enumerate(self.slice_lengths):
            length = self.rows(microbatch, j) if self.rows is not None else length
            if self.last:
                kept = self.kept.pop((microbatch, j))
                for r in range(self.head.size - 1):
                    for kind, t in zip((_HIDDEN, _LABELS, _MASK), kept):
                        pending.append(dist.isend(t.contiguous(), ranks[r], group, self._tag(kind, microbatch, j)))
                slices.append(kept)
                continue
            b, h = self.micro_batch, self.hidden_size
            bufs = (
                torch.empty(length, b, h, dtype=self.head.weight.dtype),
                torch.empty(b, length, dtype=torch.int64),
                torch.empty(b, length, dtype=torch.float32),
            )
            for kind, t in zip((_HIDDEN, _LABELS, _MASK), bufs):
                receive(t, ranks[-1], group, self._tag(kind, microbatch, j))
            slices.append(bufs)
        return slices

    def join(self, microbatch: int) -> None:
        """Steps 1 to 4 for ``microbatch`` (see the module doc); every pipeline rank calls it."""
        pending: list = []
        slices = self._hand_out(microbatch, pending)
        count = sum((m.float().sum() for _, _, m in slices), torch.zeros(()))
        total, cp = count.clone(), 1
        if self.head.cp_group is not None:
            cp = dist.get_world_size(self.head.cp_group)
            dist.all_reduce(total, group=self.head.cp_group)
        scale = cp / (torch.clamp(total, min=1) * self.num_microbatches)
        lo, _ = self.head.ids_of(self.head.index)
        loss_sum = torch.zeros(())
        my_grads = []
        for hidden, labels, mask in slices:
            part = hidden.detach().requires_grad_(not self.forward_only)
            with torch.set_grad_enabled(not self.forward_only):
                losses, surrogate = vocab_parallel_cross_entropy(
                    F.linear(part, self.head.shard()), labels.t() - lo, self.head.group, self.head.tp_group
                )
            weights = mask.t().to(losses.dtype)
            if not self.forward_only:
                (torch.sum(surrogate * weights) * scale).backward()
                my_grads.append(part.grad)
            loss_sum += torch.sum(losses * weights)
        self._gather_grads(microbatch, my_grads, pending)
        for work in pending:
            work.wait()
        if self.last:
            self.reports.append({"lm loss": torch.stack([loss_sum, count])})

    def _gather_grads(self, microbatch: int, my_grads: list, pending: list) -> None:
        """Step 4: every rank's hidden-state gradient of each slice, summed on the last rank."""
        if self.forward_only:
            return
        group, ranks = self.head.group, self.head.pp_ranks
        for j, grad in enumerate(my_grads):
            if not self.last:
                pending.append(dist.isend(grad.contiguous(), ranks[-1], group, self._tag(_GRAD, microbatch, j)))
                continue
            total = torch.zeros_like(grad)
            for r in range(self.head.size - 1):
                buf = torch.empty_like(grad)
                receive(buf, ranks[r], group, self._tag(_GRAD, microbatch, j))
                total += buf
            total += grad
            if self.head.tp_group is not None:  # the other TP ranks' vocabulary shards' parts
                dist.all_reduce(total, group=self.head.tp_group)
            self.grads[(microbatch, j)] = total


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    group: Optional[dist.ProcessGroup],
    tp_group: Optional[dist.ProcessGroup] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross entropy over logits whose vocabulary is split over ``group`` (and ``tp_group``, if
    any, each of whose ranks holds another split of the vocabulary over its own ``group``): this rank's ``logits``
    ``[tokens, b, rows]`` and the ``targets`` ``[tokens, b]`` counted from its first row (outside
    ``[0, rows)`` on the other ranks). Returns ``(losses, surrogate)``: the per-token losses (no
    gradient, the same on every rank) and a per-token term whose gradient with respect to
    ``logits`` is this rank's part of the loss gradient, ``softmax - one_hot``."""
    logits = logits.float()
    peak = logits.detach().max(-1).values
    _all_reduce(peak, dist.ReduceOp.MAX, group, tp_group)
    exp_sum = torch.exp(logits - peak.unsqueeze(-1)).sum(-1)
    mine = (targets >= 0) & (targets < logits.shape[-1])
    target = logits.gather(-1, targets.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1) * mine
    totals = torch.stack([exp_sum.detach(), target.detach()])
    _all_reduce(totals, dist.ReduceOp.SUM, group, tp_group)
    losses = torch.log(totals[0]) + peak - totals[1]
    return losses, exp_sum / totals[0] - target


def _all_reduce(tensor: torch.Tensor, op: Any, *groups: Optional[dist.ProcessGroup]) -> None:
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(tensor, op=op, group=group)
