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
from typing import Hashable

from megatron_slim.plan.schedule.ir import Action, Kind, Schedule
from megatron_slim.plan.schedule.validate import ScheduleError, comm_key

_RECEIVES = (Kind.RECV_F, Kind.RECV_B)
_SENDS = (Kind.SEND_F, Kind.SEND_B)


Joins = tuple[tuple[tuple[int, tuple[Hashable, ...]], ...], ...]  # per rank: (position, joins met there)


@functools.lru_cache(maxsize=16)  # the runtime asks once per step for the same few schedules
def receive_posts(schedule: Schedule, joins: Joins = ()) -> tuple[dict[int, tuple[Action, ...]], ...]:
    """Per rank, ``{step index: receives to post before running that step}``; every ``RECV`` of
    the rank appears exactly once, at its own index or earlier. ``joins``: exchanges every rank
    meets before running the step at a position (``schedule.vocab_parallel``'s, ``vocab_joins``),
    each a point where no rank passes before all have come; the walk holds ranks there alike."""
    walk = _Walk(schedule, [dict(j) for j in joins] if joins else [{} for _ in schedule.ranks])
    while not walk.done():
        before = walk.progress()
        for rank in range(len(schedule.ranks)):
            walk.advance(rank)
        if walk.progress() == before:
            raise ScheduleError("receive placement stalled: a RECV whose send no rank reaches, or a join one misses")
    return tuple({index: tuple(actions) for index, actions in p.items()} for p in walk.posts)


class _Walk:
    def __init__(self, schedule: Schedule, joins: list[dict[int, tuple[Hashable, ...]]]) -> None:
        self.schedule, self.rows, self.joins = schedule, schedule.ranks, joins
        self.receiver = {
            comm_key(schedule, r, a): (r, a) for r, row in enumerate(self.rows) for a in row if a.kind in _RECEIVES
        }
        self.at = [0] * len(self.rows)  # each rank's next step
        self.met = [0] * len(self.rows)  # joins met at its current position
        self.arrived: dict[Hashable, set[int]] = {}
        self.unissued: list[list[Action]] = [[] for _ in self.rows]  # sends since its last communication point
        self.posts: list[dict[int, list[Action]]] = [{} for _ in self.rows]
        self.placed: set[tuple[str, int, int, int]] = set()

    def progress(self) -> tuple[tuple[int, ...], tuple[int, ...], int]:
        return tuple(self.at), tuple(self.met), sum(len(came) for came in self.arrived.values())

    def done(self) -> bool:
        return all(self._finished(r) for r in range(len(self.rows)))

    def _finished(self, rank: int) -> bool:
        return self.at[rank] == len(self.rows[rank]) and self.met[rank] == len(self.joins[rank].get(self.at[rank], ()))

    def issue(self, rank: int) -> None:  # the rank's communication point goes out: its receivers post now
        for send in self.unissued[rank]:
            key = comm_key(self.schedule, rank, send)
            dst, recv = self.receiver[key]
            self.posts[dst].setdefault(self.at[dst], []).append(recv)
            self.placed.add(key)
        self.unissued[rank].clear()

    def _meet(self, rank: int) -> bool:
        """Meet the joins at the rank's position; False while one waits for another rank."""
        pending = self.joins[rank].get(self.at[rank], ())
        while self.met[rank] < len(pending):
            self.issue(rank)
            came = self.arrived.setdefault(pending[self.met[rank]], set())
            came.add(rank)
            if len(came) < len(self.rows):
                return False
            self.met[rank] += 1
        return True

    def advance(self, rank: int) -> None:
        """Run the rank up to its next compute (the ranks walk in lockstep), a wait or a join."""
        row = self.rows[rank]
        while self._meet(rank) and self.at[rank] < len(row):
            a = row[self.at[rank]]
            if a.kind in _SENDS:
                self.unissued[rank].append(a)
            elif a.kind in _RECEIVES:
                self.issue(rank)
                if comm_key(self.schedule, rank, a) not in self.placed:
                    break  # waits for its sender
            else:
                self.issue(rank)
            self.at[rank], self.met[rank] = self.at[rank] + 1, 0
            if a.kind.is_compute:
                break
        if self.at[rank] == len(row) and self._meet(rank):
            self.issue(rank)


def posted_before(schedule: Schedule, rank: int) -> dict[Action, Action]:
    """``{RECV: the action before which it is posted}`` for ``rank`` (the ``RECV`` itself where it
    is posted in place)."""
    row = schedule.ranks[rank]
    return {recv: row[index] for index, recvs in receive_posts(schedule)[rank].items() for recv in recvs}


__all__ = ["posted_before", "receive_posts"]
