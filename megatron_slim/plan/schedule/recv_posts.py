"""Where each receive is posted: right after the last compute action ahead of the one that waits for it.

A ``RECV`` in a lowered schedule is where the rank *waits* for a message. Posting the receive
earlier lets the transfer start before the rank needs it, and on NCCL a send cannot progress
before its receive is posted. So each receive is posted right after the last compute action that
precedes its ``RECV`` on the same rank (after the ``F`` before a ``RECV_B``, say), at the same
point as that compute's sends, and waited for at the ``RECV``.

Why after that compute and not before it: NCCL runs the messages between two ranks in the order
they are posted, on one stream, and a send of more than its buffers hold waits for its receive.
Posting before the compute put a rank's receive ahead of the send its compute produces, while
the peer did the same the other way round (at 1F1B's steady state: stage ``s`` posts the
gradient's receive then sends the next activation, stage ``s + 1`` posts that activation's
receive then sends the gradient), and each receive waited for a send queued behind the other's
(``runtime/nccl_rules`` reports it). Posted after the compute, the receives and sends of one
point go out as one ``batch_isend_irecv`` (``runtime/pipeline/p2p.py``), which NCCL runs as one
group: Megatron's ``send_forward_recv_backward`` at the same place.

Posting keeps the ``RECV`` order: receives are posted in the same order as their ``RECV`` actions
(several posted at one point keep their row order), so a directed link still sees its messages in
the order ``validate.check_link_order`` checked. A ``RECV`` with no compute before it on its rank
is posted where it stands.

The runtime (``runtime/pipeline/interpreter.py``) posts the listed receives before running the
action at that index; the simulator (``plan/sim/in_flight.py``) holds the received buffer from
the same point; so the activation meter and the simulated peak count the same spans.
"""

from __future__ import annotations

import functools

from megatron_slim.plan.schedule.ir import Action, Kind, Schedule

_RECEIVES = (Kind.RECV_F, Kind.RECV_B)


@functools.lru_cache(maxsize=16)  # the runtime asks once per step for the same few schedules
def receive_posts(schedule: Schedule) -> tuple[dict[int, tuple[Action, ...]], ...]:
    """Per rank, ``{step index: receives to post before running that step}``; every ``RECV`` of
    the rank appears exactly once, at its own index or right after an earlier compute action."""
    out = []
    for row in schedule.ranks:
        posts: dict[int, list[Action]] = {}
        last_compute = None
        for index, a in enumerate(row):
            if a.kind.is_compute:
                last_compute = index
            elif a.kind in _RECEIVES:
                posts.setdefault(index if last_compute is None else last_compute + 1, []).append(a)
        out.append({index: tuple(actions) for index, actions in posts.items()})
    return tuple(out)


def posted_before(schedule: Schedule, rank: int) -> dict[Action, Action]:
    """``{RECV: the action before which it is posted}`` for ``rank`` (the ``RECV`` itself where it
    is posted in place)."""
    row = schedule.ranks[rank]
    return {recv: row[index] for index, recvs in receive_posts(schedule)[rank].items() for recv in recvs}


__all__ = ["posted_before", "receive_posts"]
