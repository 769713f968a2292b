"""Where each pipeline rank joins the vocabulary exchange of a microbatch (``schedule.vocab_parallel``).

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
