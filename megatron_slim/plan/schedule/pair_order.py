"""Whether two ranks post the messages between them in an order NCCL can run.

NCCL runs the point-to-point messages between two ranks on one stream, in the order they are
posted, and a send of more than its buffers hold waits for its receive; the operations of one
``batch_isend_irecv`` run as one group. The runtime posts a rank's sends and receives between two
compute actions, or up to a wait, as one batch (``runtime/pipeline/p2p.py``), receives where
``recv_posts`` places them. This replays that per rank and checks every message: when rank B
issues a message to A, the number of A's messages B has posted receives for (by then, within its
batch) must agree with the number A has sent B when A posts the receive (within A's batch). When
they cannot agree, each rank waits for a message queued behind its own: ``runtime/nccl_rules``
fails the run on gloo the same way.
"""

from __future__ import annotations

from typing import Mapping, Optional

from megatron_slim.plan.schedule.ir import Action, Kind, Schedule
from megatron_slim.plan.schedule.recv_posts import Joins, receive_posts
from megatron_slim.plan.schedule.validate import CommKey, comm_key

Event = tuple[str, int, CommKey]  # ("send" | "recv", peer rank, message)
Posts = tuple[Mapping[int, tuple[Action, ...]], ...]


def batches(schedule: Schedule, rank: int, posts: Posts, joins_at: frozenset[int] = frozenset()) -> list[list[Event]]:
    """The rank's communication points in the runtime's order, each as the events it posts (a
    point also ends where the rank meets a vocabulary exchange, ``joins_at``)."""
    out: list[list[Event]] = []
    current: list[Event] = []
    posted: set[Action] = set()

    def event(kind: str, a: Action) -> Event:
        key = comm_key(schedule, rank, a)
        backward = a.kind in (Kind.SEND_B, Kind.RECV_B)
        peer_stage = key[1] + (1 if backward else -1) if kind == "recv" else key[1]
        return kind, schedule.placement(peer_stage)[0], key

    for step, a in enumerate(schedule.ranks[rank]):
        for recv in posts[rank].get(step, ()):
            if recv != a:
                current.append(event("recv", recv))
                posted.add(recv)
        if (a.kind.is_compute or step in joins_at) and current:
            out.append(current)
            current = []
        if a.kind in (Kind.SEND_F, Kind.SEND_B):
            current.append(event("send", a))
        elif a.kind in (Kind.RECV_F, Kind.RECV_B):
            if a not in posted:
                current.append(event("recv", a))
            out.append(current)
            current = []
    if current:
        out.append(current)
    return out


def _spans(points: list[list[Event]], peer: int) -> dict[tuple[str, CommKey], tuple[tuple[int, int], tuple[int, int]]]:
    """Per event with ``peer``: sends to it and receives from it posted before its batch, and by its end."""
    sent = received = 0
    out = {}
    for point in points:
        mine = [e for e in point if e[1] == peer]
        sends = sum(e[0] == "send" for e in mine)
        receives = len(mine) - sends
        for kind, _, key in mine:
            out[(kind, key)] = ((sent, sent + sends), (received, received + receives))
        sent, received = sent + sends, received + receives
    return out


def crossing(received: tuple[int, int], sent: tuple[int, int]) -> Optional[str]:
    """How a message's two ends cross, or None. ``received``: the receives of the other direction
    the sender had posted before the message's batch and by its end; ``sent``: the sends of the
    other direction the receiver had posted before its receive's batch and by its end. ``"sends"``:
    each side sent before receiving the other's message (NCCL deadlocks once messages outgrow its
    buffers); ``"receives"``: each received before sending (NCCL always deadlocks)."""
    if received[1] < sent[0]:
        return "sends"
    if received[0] > sent[1]:
        return "receives"
    return None


def pair_order_problems(schedule: Schedule, posts: Optional[Posts] = None, joins: Joins = ()) -> list[str]:
    """Every message whose two ends disagree (empty when NCCL can run the schedule's messages);
    ``joins``: the vocabulary exchanges' positions, as ``receive_posts`` takes them."""
    posts = receive_posts(schedule, joins) if posts is None else posts
    where = [frozenset(position for position, _ in joins[r]) if joins else frozenset() for r in range(len(posts))]
    points = [batches(schedule, r, posts, where[r]) for r in range(len(schedule.ranks))]
    problems = []
    for a in range(len(points)):
        for b in range(len(points)):
            mine, theirs = _spans(points[a], b), _spans(points[b], a)
            for (kind, key), (sent, _) in mine.items():
                if kind != "recv" or ("send", key) not in theirs:
                    continue
                received = theirs[("send", key)][1]
                if crossing(received, sent):
                    problems.append(
                        f"message {key} from rank {b} to rank {a}: rank {b} had posted {received} receives of rank "
                        f"{a}'s messages when it sent it, rank {a} had sent {sent} when it posted its receive"
                    )
    return problems
