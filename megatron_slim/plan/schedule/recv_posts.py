"""Where each receive is posted: one compute action ahead of the action that waits for it.

A ``RECV`` in a lowered schedule is where the rank *waits* for a message. Posting the receive only
there (``irecv().wait()`` at the action) leaves the transfer no time to overlap anything on the
receiving side, and on NCCL a send cannot progress before its receive is posted. So each receive
is posted just before the last compute action that precedes its ``RECV`` on the same rank (the
``F`` before a ``RECV_B``, say), and waited for at the ``RECV``: the transfer overlaps that
compute, the way Megatron's 1F1B posts the next step's receive before the current step's compute.

Posting keeps the ``RECV`` order: receives are posted in the same order as their ``RECV`` actions
(several posted before one compute keep their row order), so a directed link still sees its
messages in the order ``validate.check_link_order`` checked. A ``RECV`` with no compute before it
on its rank is posted where it stands.

The runtime (``runtime/pipeline/interpreter.py``) posts the listed receives before running the
compute at that index; the simulator (``plan/sim/in_flight.py``) holds the received buffer from
the same point; so the activation meter and the simulated peak count the same spans.
"""

from __future__ import annotations

import functools

from megatron_slim.plan.schedule.ir import Action, Kind, Schedule

_RECEIVES = (Kind.RECV_F, Kind.RECV_B)


@functools.lru_cache(maxsize=16)  # the runtime asks once per step for the same few schedules
def receive_posts(schedule: Schedule) -> tuple[dict[int, tuple[Action, ...]], ...]:
    """Per rank, ``{step index: receives to post before running that step}``; every ``RECV`` of
    the rank appears exactly once, at its own index or at an earlier compute action's."""
    out = []
    for row in schedule.ranks:
        posts: dict[int, list[Action]] = {}
        last_compute = None
        for index, a in enumerate(row):
            if a.kind.is_compute:
                last_compute = index
            elif a.kind in _RECEIVES:
                posts.setdefault(index if last_compute is None else last_compute, []).append(a)
        out.append({index: tuple(actions) for index, actions in posts.items()})
    return tuple(out)


def posted_before(schedule: Schedule, rank: int) -> dict[Action, Action]:
    """``{RECV: the action before which it is posted}`` for ``rank`` (the ``RECV`` itself where it
    is posted in place)."""
    row = schedule.ranks[rank]
    return {recv: row[index] for index, recvs in receive_posts(schedule)[rank].items() for recv in recvs}


__all__ = ["posted_before", "receive_posts"]
