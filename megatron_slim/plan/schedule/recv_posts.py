"""Where each receive is posted: in the receiver's communication point that is current when the
sender issues the message, as a lockstep walk of every rank's row finds it.

A ``RECV`` in a lowered schedule is where the rank *waits* for a message; its receive is posted
earlier, so the transfer starts as soon as the sender issues it (and on NCCL a send cannot progress
before its receive is posted). The runtime groups a rank's sends and receives between two compute
actions, or up to a wait, into one communication point, issued as one ``batch_isend_irecv``
(``runtime/pipeline/p2p.py``).

Why the placement matters: NCCL runs the messages between two ranks in the order they are posted,
on one stream, and a send of more than its buffers hold waits for its receive. If rank A posts a
send to B before the receive of a message B sent before posting its receive of A's message, each
waits for the other (``runtime/nccl_rules`` reports it on gloo). Posting every receive in the
receiver's point that is current when its sender's point is issued, in one lockstep walk of all
rows, makes the two ranks of every pair agree, at each message, on how many messages have gone the
other way: the condition ``pair_order.pair_order_problems`` verifies. (Posting one compute ahead, the
rule before, crossed the two directions at 1F1B's steady state; posting right after the compute
ahead still crossed them under interleaving.)

Posting keeps each directed link's order: sends on a link are issued in order, so their receives
are placed in that order (several at one index keep it), which ``validate.check_link_order``
checked against the ``RECV`` order. Every receive is placed at or before its ``RECV``.

The runtime (``runtime/pipeline/interpreter.py``) posts the listed receives before running the
action at that index; the simulator (``plan/sim/engine.py``) holds the received buffer from the
same point; so the activation meter and the simulated peak count the same spans.
"""

from __future__ import annotations

import functools

from megatron_slim.plan.schedule.ir import Action, Kind, Schedule
from megatron_slim.plan.schedule.validate import ScheduleError, comm_key

_RECEIVES = (Kind.RECV_F, Kind.RECV_B)
_SENDS = (Kind.SEND_F, Kind.SEND_B)


@functools.lru_cache(maxsize=16)  # the runtime asks once per step for the same few schedules
def receive_posts(schedule: Schedule) -> tuple[dict[int, tuple[Action, ...]], ...]:
    """Per rank, ``{step index: receives to post before running that step}``; every ``RECV`` of
    the rank appears exactly once, at its own index or earlier."""
    rows = schedule.ranks
    receiver = {comm_key(schedule, r, a): (r, a) for r, row in enumerate(rows) for a in row if a.kind in _RECEIVES}
    at = [0] * len(rows)  # each rank's next step
    unissued: list[list[Action]] = [[] for _ in rows]  # sends since the rank's last communication point
    posts: list[dict[int, list[Action]]] = [{} for _ in rows]
    placed: set[tuple[str, int, int, int]] = set()

    def issue(rank: int) -> None:  # the rank's communication point goes out: its receivers post now
        for send in unissued[rank]:
            key = comm_key(schedule, rank, send)
            dst, recv = receiver[key]
            posts[dst].setdefault(at[dst], []).append(recv)
            placed.add(key)
        unissued[rank].clear()

    while any(step < len(row) for step, row in zip(at, rows)):
        moved = False
        for rank, row in enumerate(rows):
            while at[rank] < len(row):
                a = row[at[rank]]
                if a.kind in _SENDS:
                    unissued[rank].append(a)
                elif a.kind in _RECEIVES:
                    issue(rank)
                    if comm_key(schedule, rank, a) not in placed:
                        break  # waits for its sender
                else:
                    issue(rank)
                at[rank] += 1
                moved = True
                if a.kind.is_compute:
                    break  # one compute per rank per sweep: the ranks walk in lockstep
            if at[rank] == len(row):
                issue(rank)
        if not moved:
            raise ScheduleError("receive placement stalled: a RECV whose send no rank reaches")
    return tuple({index: tuple(actions) for index, actions in p.items()} for p in posts)


def posted_before(schedule: Schedule, rank: int) -> dict[Action, Action]:
    """``{RECV: the action before which it is posted}`` for ``rank`` (the ``RECV`` itself where it
    is posted in place)."""
    row = schedule.ranks[rank]
    return {recv: row[index] for index, recvs in receive_posts(schedule)[rank].items() for recv in recvs}


__all__ = ["posted_before", "receive_posts"]
