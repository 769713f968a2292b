"""Data dependencies between compute actions, keyed by global stage.

A key is ``(kind, stage, microbatch, slice)``. The rules (shared by validator, simulator and
runtime checks):

* ``F(s, m, j)`` needs ``F(s-1, m, j)`` (its input) and ``F(s, m, j-1)`` (the K/V cache of the
  earlier slices of the same microbatch on this stage).
* ``B(s, m, j)`` / ``I(s, m, j)`` needs ``F(s, m, j)``; the output gradient from ``B(s+1, m, j)``
  (or, on the last stage, the loss, which needs the whole microbatch's forward there:
  ``F(S-1, m, n-1)``); and ``B(s, m, j+1)``, whose backward finishes slice j's dK/dV.
* ``W(s, m, j)`` needs ``I(s, m, j)``.
"""

from __future__ import annotations

from typing import Iterator

from megatron_slim.plan.schedule.ir import Action, Kind, Schedule

Key = tuple[Kind, int, int, int]


def key(schedule: Schedule, rank: int, action: Action) -> Key:
    kind = Kind.B if action.kind is Kind.I else action.kind
    return (kind, schedule.stage(rank, action.chunk), action.microbatch, action.slice)


def compute_dependencies(schedule: Schedule, rank: int, action: Action) -> Iterator[Key]:
    """Keys that must be done before ``action`` on ``rank`` may run (``I`` is keyed as ``B``)."""
    stage = schedule.stage(rank, action.chunk)
    mb, j = action.microbatch, action.slice
    last_stage = schedule.num_stages - 1
    if action.kind is Kind.F:
        if stage > 0:
            yield (Kind.F, stage - 1, mb, j)
        if j > 0:
            yield (Kind.F, stage, mb, j - 1)
    elif action.kind in (Kind.B, Kind.I):
        yield (Kind.F, stage, mb, j)
        if stage < last_stage:
            yield (Kind.B, stage + 1, mb, j)
        else:
            yield (Kind.F, stage, mb, schedule.num_slices - 1)
        if j < schedule.num_slices - 1:
            yield (Kind.B, stage, mb, j + 1)
    elif action.kind is Kind.W:
        yield (Kind.B, stage, mb, j)


def peer_rank(schedule: Schedule, rank: int, action: Action) -> int:
    """The rank a SEND goes to or a RECV comes from."""
    stage = schedule.stage(rank, action.chunk)
    if action.kind in (Kind.SEND_F, Kind.RECV_B):
        return schedule.placement(stage + 1)[0]
    if action.kind in (Kind.RECV_F, Kind.SEND_B):
        return schedule.placement(stage - 1)[0]
    raise ValueError(f"{action} is not a communication action")
