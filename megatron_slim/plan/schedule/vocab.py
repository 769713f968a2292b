"""Where each pipeline rank meets the vocabulary exchanges (``schedule.vocab_parallel``):
``vocab_joins(schedule, rank)``.

Two exchanges, both with every pipeline rank:

* the output layer's, once per microbatch (``OutputJoin``): the last stage's final hidden states of
  the microbatch are cut along the sequence and handed to every rank, each computes the logits and
  cross entropy of its part and hands the hidden-state gradient back (``runtime/pipeline/vocab.py``);
* the input embedding's, once per slice (``EmbeddingJoin``): inside stage 0's forward of the slice
  its ids are cut along the sequence, each rank looks up its part and sends the rows back, after
  taking the embedding gradients of the backwards stage 0 ran since its previous lookup
  (``runtime/pipeline/vocab_embedding.py``).

Where each rank meets them, and why no rank waits forever, with one model chunk per rank or several
(interleaved: the embedding on rank 0's first chunk, the output layer after the last rank's last
chunk), is ``plan/schedule/vocab_cuts.py``. With one chunk per rank: the last rank right after its
forward of a microbatch's last slice, every other rank right after it sends that forward; each rank
serves a slice right before it receives the slice's forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from megatron_slim.plan.schedule.ir import Kind, Schedule
from megatron_slim.plan.schedule.vocab_cuts import cut_of, vocab_cuts

Slice = tuple[int, int]  # (microbatch, slice)


@dataclass(frozen=True)
class OutputJoin:
    """Every rank's part of a microbatch's output layer and loss."""

    microbatch: int


@dataclass(frozen=True)
class EmbeddingJoin:
    """One meeting of stage 0 with every other rank over the input embedding."""

    lookup: Slice  # whose input ids are looked up
    grads: tuple[Slice, ...]  # slices whose embedding gradients are handed over first


Join = Union[OutputJoin, EmbeddingJoin]


def vocab_joins(schedule: Schedule, rank: int) -> tuple[dict[int, tuple[Join, ...]], tuple[Slice, ...]]:
    """``({position: joins}, tail)`` for ``rank``: it meets ``joins``, in order, after the first
    ``position`` steps of its row (stage 0 meets an ``EmbeddingJoin`` inside the forward at that
    step). ``tail``: the embedding gradients of the backwards stage 0 runs after its last forward,
    handed over after every row ends. ``ValueError`` for a schedule the exchanges cannot run in."""
    cuts = vocab_cuts(schedule)
    grads, tail = _embedding_grads(schedule)
    joins: dict[int, tuple[Join, ...]] = {}
    for event in cuts.order:
        kind, index = event
        key, _ = cuts.lookups[index] if kind == "emb" else (None, None)
        join: Join = OutputJoin(index) if key is None else EmbeddingJoin(key, grads[key])
        position = cut_of(cuts, event)[rank]
        joins[position] = joins.get(position, ()) + (join,)
    return joins, tail


def every_rank_joins(schedule: Schedule) -> tuple[tuple[tuple[int, tuple[Join, ...]], ...], ...]:
    """Every rank's ``(position, joins)``, as ``recv_posts.receive_posts`` takes them."""
    return tuple(
        tuple(sorted(vocab_joins(schedule, r)[0].items(), key=lambda item: item[0])) for r in range(schedule.pp)
    )


def _embedding_grads(schedule: Schedule) -> tuple[dict[Slice, tuple[Slice, ...]], tuple[Slice, ...]]:
    """Per lookup of stage 0, the backwards it ran on its first chunk since its previous lookup; and
    those after its last."""
    grads: dict[Slice, tuple[Slice, ...]] = {}
    done: list[Slice] = []
    for a in schedule.ranks[0]:
        if a.chunk != 0:
            continue
        if a.kind is Kind.B:
            done.append((a.microbatch, a.slice))
        elif a.kind is Kind.F:
            grads[(a.microbatch, a.slice)] = tuple(done)
            done = []
    return grads, tuple(done)
