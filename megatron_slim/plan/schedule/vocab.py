"""Where each pipeline rank joins the vocabulary exchanges (``schedule.vocab_parallel``): the output
layer's, once per microbatch (``vocab_exchange_steps``, below), and the input embedding's, once per
slice (``embedding_exchange_steps``, argued in its doc).

With the output layer spread over the pipeline ranks, the last stage's final hidden states of a
microbatch are cut along the sequence and handed to every rank, each computes the logits and
cross entropy of its part and hands the hidden-state gradient back (``runtime/pipeline/vocab.py``).
All ranks do this for microbatch ``m`` together, at one point of each row:

* the last rank: right after its forward of the microbatch's last slice (its backward of the
  microbatch needs the loss of every slice, so no earlier point has all hidden states, and its
  first backward of ``m`` needs the gradients);
* every other rank: right after it sends the forward of the microbatch's last slice.

Why no rank waits forever (one model chunk per rank): before its point, a rank only ever waits
for forward inputs of microbatches up to ``m`` (sent before the senders' own points) and for
backward gradients of earlier microbatches (whose exchanges every rank has already joined, since
forwards run in microbatch order on every rank). A backward gradient of microbatch ``m`` itself
cannot be awaited before the point: it needs the last stage's loss of ``m``, hence the forward of
``m``'s last slice this rank sends at its point, and a valid schedule never waits for it earlier.
Interleaved schedules (several chunks per rank) are not covered by that argument and are refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_slim.plan.schedule.ir import Kind, Schedule


def vocab_exchange_steps(schedule: Schedule, rank: int) -> dict[int, int]:
    """``{step index: microbatch}``: after running step ``i`` of its row, ``rank`` joins the
    exchange of that microbatch. Raises ``ValueError`` for schedules it does not cover."""
    if schedule.vpp != 1:
        raise ValueError(
            f"schedule.vocab_parallel: {schedule.vpp} model chunks per pipeline rank; allowed: parallel.vpp=1"
        )
    last_slice = schedule.num_slices - 1
    kind = Kind.F if rank == schedule.pp - 1 else Kind.SEND_F
    steps = {i: a.microbatch for i, a in enumerate(schedule.ranks[rank]) if a.kind is kind and a.slice == last_slice}
    expected = list(range(schedule.num_microbatches))
    if sorted(steps.values()) != expected or list(steps.values()) != expected:
        raise ValueError(
            f"schedule.vocab_parallel: rank {rank} finishes its forwards in microbatch order "
            f"{list(steps.values())}; allowed: schedules whose forwards run in microbatch order"
        )
    return steps


@dataclass(frozen=True)
class EmbeddingJoin:
    """One meeting of stage 0 with every other rank over the input embedding (``schedule.vocab_parallel``)."""

    lookup: tuple[int, int]  # (microbatch, slice) whose input ids are looked up
    grads: tuple[tuple[int, int], ...]  # slices whose embedding gradients are handed over first


def embedding_exchange_steps(
    schedule: Schedule, rank: int
) -> tuple[dict[int, EmbeddingJoin], tuple[tuple[int, int], ...]]:
    """``({step index: join}, tail)`` for ``rank``: stage 0 meets every rank inside its forward of
    each slice (the step of that ``F``), every other rank right before the step that receives the
    slice's forward input (``RECV_F``). A join first hands over the embedding gradients of the
    backwards stage 0 ran since its previous forward; ``tail``: those it ran after its last forward,
    handed over after every row ends.

    Why no rank waits forever (one chunk per rank): stage 0 at ``F(m, j)`` waits for every rank ``r``
    to reach its ``RECV_F(m, j)``, which ``r`` would reach in the schedule without the embedding too
    (the schedule never makes ``r`` wait, before it, for anything that needs stage 0's ``F(m, j)``:
    such a wait would already deadlock the schedule, since ``r``'s ``RECV_F(m, j)`` needs that
    forward). Rank ``r`` at its join waits only for stage 0 to reach ``F(m, j)``, which its
    ``RECV_F(m, j)`` waits for anyway. So each join adds no wait the schedule does not already have
    in one direction, and in the other only waits for steps the schedule already runs first. With
    the output exchange too: a rank inside microbatch ``m``'s output exchange has served every slice
    of ``m``, and stage 0 joins that exchange right after sending ``m``'s last slice, before any
    forward of a later microbatch, so neither waits on the other there (the joins are
    point-to-point, tagged apart; ``tests/plan/test_embedding_exchange_steps.py`` walks both).
    """
    vocab_exchange_steps(schedule, rank)  # the same coverage: one chunk, forwards in microbatch order
    joins: dict[tuple[int, int], EmbeddingJoin] = {}
    step_of: dict[tuple[int, int], int] = {}
    done: list[tuple[int, int]] = []
    for i, a in enumerate(schedule.ranks[0]):
        if a.kind is Kind.B:
            done.append((a.microbatch, a.slice))
        elif a.kind is Kind.F:
            joins[(a.microbatch, a.slice)] = EmbeddingJoin((a.microbatch, a.slice), tuple(done))
            step_of[(a.microbatch, a.slice)] = i
            done = []
    if rank > 0:
        step_of = {(a.microbatch, a.slice): i for i, a in enumerate(schedule.ranks[rank]) if a.kind is Kind.RECV_F}
    if step_of.keys() != joins.keys():
        raise ValueError(
            f"schedule.vocab_parallel: rank {rank} receives forwards {sorted(step_of)} but stage 0 runs "
            f"{sorted(joins)}; allowed: schedules where every rank receives each slice stage 0 computes"
        )
    return {i: joins[key] for key, i in step_of.items()}, tuple(done)
