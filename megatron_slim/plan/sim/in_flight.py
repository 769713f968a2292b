"""The simulator's count of point-to-point buffers in flight, per rank.

A message is one slice's activation (forward) or input gradient (backward) between two ranks.
Its sender holds the buffer from the ``SEND`` until the transfer completes (it needs both ends
posted: the data has arrived and the receive is posted); the receiver holds its buffer from
posting the receive, ahead of its ``RECV`` (``plan/schedule/recv_posts.py``), until
the compute that consumes it starts. The runtime's ``ActivationMeter`` counts the same spans
(``runtime/pipeline/memory_meter.py``).
"""

from __future__ import annotations

from megatron_slim.plan.schedule.ir import Action, Kind, Schedule

# (time, activation, K/V[, sent-buffer, received-buffer bytes[, -1: ahead of the instant's other changes]]):
# changes, in the order they happen
MemoryDelta = tuple[float, ...]
Message = tuple[bool, int, int, int]  # (forward, receiving stage, microbatch, slice)

_RECV_CONSUMED_BY = {Kind.F: Kind.RECV_F, Kind.B: Kind.RECV_B, Kind.I: Kind.RECV_B}


class InFlight:
    def __init__(self, schedule: Schedule, deltas: list[list[MemoryDelta]]) -> None:
        """Appends to ``deltas[rank]``, the simulator's memory changes of each rank."""
        self.schedule = schedule
        self.deltas = deltas
        self._sent: dict[Message, tuple[int, float]] = {}  # message -> (sending rank, bytes)
        self._received: dict[tuple[int, Kind, int, int, int], float] = {}  # (rank, RECV kind, unit) -> bytes

    def _message(self, rank: int, a: Action) -> Message:
        stage = self.schedule.stage(rank, a.chunk)
        if a.kind is Kind.SEND_F:
            return (True, stage + 1, a.microbatch, a.slice)
        if a.kind is Kind.SEND_B:
            return (False, stage - 1, a.microbatch, a.slice)
        return (a.kind is Kind.RECV_F, stage, a.microbatch, a.slice)

    def sent(self, rank: int, a: Action, nbytes: float, at: float) -> None:
        self._sent[self._message(rank, a)] = (rank, nbytes)
        self.deltas[rank].append((at, 0.0, 0.0, nbytes, 0.0))

    def posted(self, rank: int, a: Action, at: float, completed_at: float, ahead: bool = False) -> None:
        """The receive of ``RECV`` ``a`` posted ``at``, its transfer completed at ``completed_at``
        (which frees the sender's buffer). ``ahead``: posted before the changes recorded for the
        same instant so far (it was posted at a communication point, before the compute that starts
        then consumes its input, though the simulator reaches the ``RECV`` later)."""
        sender, nbytes = self._sent.pop(self._message(rank, a))
        self.deltas[sender].append((completed_at, 0.0, 0.0, -nbytes, 0.0))
        self.deltas[rank].append((at, 0.0, 0.0, 0.0, nbytes) + ((-1.0,) if ahead else ()))
        self._received[(rank, a.kind, a.chunk, a.microbatch, a.slice)] = nbytes

    def consumed(self, rank: int, a: Action, at: float) -> None:
        """Compute ``a`` starts ``at``: the buffer received for it, if any, becomes its input."""
        kind = _RECV_CONSUMED_BY.get(a.kind)
        nbytes = self._received.pop((rank, kind, a.chunk, a.microbatch, a.slice), None) if kind else None
        if nbytes is not None:
            self.deltas[rank].append((at, 0.0, 0.0, 0.0, -nbytes))
