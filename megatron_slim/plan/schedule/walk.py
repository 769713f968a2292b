"""Readiness: which action of a schedule may run, given what has run so far.

One set of rules, read by the validator (does every rank reach its end?) and the simulator (when
does each action start?). Each action, once run, makes one *fact* available:

* a compute action: its dependency key (``deps.key``: ``(kind, stage, microbatch, slice)``);
* a ``SEND``/``RECV``: ``("comm", rank, kind, stage, microbatch, slice)``, the stage being the
  acting rank's own.

An action may run when every fact it requires is available:

* compute: its ``deps.compute_dependencies``; in a lowered schedule a dependency held by another
  rank arrives through this rank's ``RECV`` of the same unit, so that ``RECV`` is required instead;
* ``SEND``: the compute whose result it sends;
* ``RECV``: the matching ``SEND`` on the peer rank;
* ``SEND`` again, once ``SEND_WINDOW`` messages are outstanding on its directed link: the peer's
  ``RECV`` of the message ``SEND_WINDOW`` places earlier on that link. The runtime keeps at most
  that many sends (and so their buffers) in flight per link and waits for the oldest before
  posting another (``runtime/pipeline/p2p.py``), and the simulator stalls the sender as the
  runtime does. Where waiting would deadlock (every rank stuck), the walk lets such a send go
  unbounded instead (``Walker._release_a_window``; ``bounded_sends`` lists the others).

Context exchange (``Schedule.exchange``) couples compute actions on several ranks: each block's
sender cannot finish without its taker's block, and the taker cannot compute it before the
sender's Q and K/V arrive, layer by layer. So the actions linked by blocks (``ExchangePlan.groups``)
run as one rendezvous, once every member is next on its rank and ready; a plan whose group never
stands ready together is a deadlock the validator reports.

``Walker.run`` advances every rank as far as the rules allow, in one fixed order, and records
each fact with the time the caller's ``step`` says it became available (the validator has no
clock and records 0).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

from megatron_slim.plan.progress import EVERY, Progress, report
from megatron_slim.plan.schedule.deps import compute_dependencies, key
from megatron_slim.plan.schedule.exchange_blocks import ExchangePlan, RankAction
from megatron_slim.plan.schedule.ir import Action, Kind, Schedule

Fact = tuple[Any, ...]  # a compute action's ``deps.Key``, or a comm fact (see above)
Step = Callable[[int, Action, float], float]  # (rank, action, ready time) -> time its fact is available
# [(rank, action, ready)] of one exchange group -> each member's time, in the same order
GroupStep = Callable[[list[tuple[int, Action, float]]], list[float]]

_RECV_FOR = {Kind.F: Kind.RECV_F, Kind.B: Kind.RECV_B}
_SEND_FOR_RECV = {Kind.RECV_F: Kind.SEND_F, Kind.RECV_B: Kind.SEND_B}
_SENT_BY = {Kind.SEND_F: Kind.F, Kind.SEND_B: Kind.B}
_RECV_FOR_SEND = {Kind.SEND_F: Kind.RECV_F, Kind.SEND_B: Kind.RECV_B}

SEND_WINDOW = 2
"""Sends a rank keeps outstanding on one directed link. Each holds its slice's buffer until its
transfer completes, so this bounds that memory to two messages per link; two (not one) let a
slice's send overlap the compute of the next slice, which is all a 1F1B-style schedule needs."""


def _comm(rank: int, kind: Kind, stage: int, a: Action) -> Fact:
    return ("comm", rank, kind, stage, a.microbatch, a.slice)


def produced(schedule: Schedule, rank: int, a: Action) -> Fact:
    """The fact ``a`` makes available once it has run on ``rank``."""
    if a.kind.is_compute:
        return key(schedule, rank, a)
    return _comm(rank, a.kind, schedule.stage(rank, a.chunk), a)


def required(schedule: Schedule, rank: int, a: Action) -> list[Fact]:
    """The facts ``a`` on ``rank`` waits for, in the order the validator reports them."""
    stage = schedule.stage(rank, a.chunk)
    if a.kind.is_compute:
        facts: list[Fact] = []
        for dep in compute_dependencies(schedule, rank, a):
            if schedule.is_lowered and schedule.placement(dep[1])[0] != rank:
                facts.append(_comm(rank, _RECV_FOR[dep[0]], stage, a))
            else:
                facts.append(dep)
        return facts
    if a.kind in _SENT_BY:
        return [(_SENT_BY[a.kind], stage, a.microbatch, a.slice)]
    peer_stage = stage - 1 if a.kind is Kind.RECV_F else stage + 1
    return [_comm(schedule.placement(peer_stage)[0], _SEND_FOR_RECV[a.kind], peer_stage, a)]


def window_waits(schedule: Schedule, window: int = SEND_WINDOW) -> dict[tuple[int, Action], Fact]:
    """``{(rank, SEND): the peer's RECV it waits for}`` for every send that finds ``window``
    messages before it on its link: it waits until the one ``window`` places earlier is received."""
    waits: dict[tuple[int, Action], Fact] = {}
    if not schedule.is_lowered:
        return waits
    for rank, row in enumerate(schedule.ranks):
        sent: dict[int, list[Fact]] = {}  # peer rank -> receive facts of this rank's sends, in order
        for a in row:
            if a.kind not in _SENT_BY:
                continue
            stage = schedule.stage(rank, a.chunk)
            peer_stage = stage + 1 if a.kind is Kind.SEND_F else stage - 1
            peer = schedule.placement(peer_stage)[0]
            link = sent.setdefault(peer, [])
            if len(link) >= window:
                waits[(rank, a)] = link[-window]
            link.append(_comm(peer, _RECV_FOR_SEND[a.kind], peer_stage, a))
    return waits


@functools.lru_cache(maxsize=16)  # the runtime asks once per step for the same few schedules
def bounded_sends(schedule: Schedule) -> frozenset[tuple[int, Action]]:
    """The ``(rank, SEND)`` pairs that wait for their link's window before posting (the others
    were released by the walk because waiting would deadlock)."""
    walker = Walker(schedule)
    walker.run(lambda rank, a, ready: 0.0)
    return frozenset(walker.window)


def describe(schedule: Schedule, fact: Fact) -> str:
    """The action behind ``fact`` and where it runs, e.g. ``SEND_F1.0 on rank 0``."""
    if fact[0] == "comm":
        _, rank, kind, stage, mb, j = fact
        return f"{Action(kind, schedule.placement(stage)[1], mb, j)} on rank {rank}"
    kind, stage, mb, j = fact
    rank, chunk = schedule.placement(stage)
    return f"{Action(kind, chunk, mb, j)} on rank {rank}"


class Walker:
    """Runs a schedule's ranks as far as readiness allows; ``done`` maps each fact to its time."""

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        self.exchange = ExchangePlan.from_text(schedule.exchange)
        self.done: dict[Fact, float] = {}
        self.pos = [0] * schedule.pp
        self.window = window_waits(schedule)

    def requires(self, rank: int, a: Action) -> list[Fact]:
        """``required`` plus, for a send, the receive the send window waits for."""
        facts = required(self.schedule, rank, a)
        waits = self.window.get((rank, a))
        return facts if waits is None else facts + [waits]

    def waiting_partner(self, rank: int, a: Action) -> Optional[RankAction]:
        """A member of ``a``'s exchange group that is not next and ready on its rank, else None."""
        for p_rank, p_action in self.exchange.group_of(rank, a):
            row = self.schedule.ranks[p_rank]
            at_head = self.pos[p_rank] < len(row) and row[self.pos[p_rank]] == p_action
            if not (at_head and self.ready_time(p_rank, p_action) is not None):
                return (p_rank, p_action)
        return None

    def _advance(self, rank: int, a: Action, t: float) -> None:
        self.done[produced(self.schedule, rank, a)] = t
        self.pos[rank] += 1

    def unmet(self, rank: int, a: Action) -> list[Fact]:
        return [f for f in self.requires(rank, a) if f not in self.done]

    def ready_time(self, rank: int, a: Action) -> Optional[float]:
        """Latest time among the facts ``a`` needs, or None while one is missing."""
        t = 0.0
        for f in self.requires(rank, a):
            at = self.done.get(f)
            if at is None:
                return None
            t = max(t, at)
        return t

    def _release_a_window(self) -> bool:
        """With every rank stuck: let the first send that waits on its window go without waiting
        (the bound would deadlock there, e.g. two ranks each sending ahead of the other's
        receives); True if one was released. Which sends are released depends on the schedule
        alone, never on the step's times, so the validator, the simulator and the runtime
        (``bounded_sends``) agree."""
        for rank, row in enumerate(self.schedule.ranks):
            if self.pos[rank] < len(row):
                waits = self.window.get((rank, row[self.pos[rank]]))
                if waits is not None and waits not in self.done:
                    del self.window[(rank, row[self.pos[rank]])]
                    return True
        return False

    def run(
        self,
        step: Step,
        progress: Optional[Progress] = None,
        phase: str = "walking",
        group_step: Optional[GroupStep] = None,
    ) -> dict[int, int]:
        """Run ``step`` on each action once it is ready; return ``{rank: step}`` where ranks stuck.
        An exchange group runs through ``group_step`` (default: ``step`` on each member).
        ``progress(phase, actions run, actions)`` at the start and every ``EVERY`` actions."""
        rows = self.schedule.ranks
        total = sum(len(row) for row in rows)
        report(progress, phase, 0, total)
        steps = 0
        progressed = True
        while progressed or self._release_a_window():
            progressed = False
            for rank, row in enumerate(rows):
                while self.pos[rank] < len(row):
                    a = row[self.pos[rank]]
                    ready = self.ready_time(rank, a)
                    if ready is None or self.waiting_partner(rank, a) is not None:
                        break
                    group = self.exchange.group_of(rank, a)
                    if not group:
                        self._advance(rank, a, step(rank, a, ready))
                        ran = 1
                    else:
                        ran = len(group)
                        self._run_group(step, group_step, group)
                    progressed = True
                    for _ in range(ran):
                        steps += 1
                        if steps % EVERY == 0:
                            report(progress, phase, steps, total)
        return {r: self.pos[r] for r, row in enumerate(rows) if self.pos[r] < len(row)}

    def _run_group(self, step: Step, group_step: Optional[GroupStep], group: tuple[RankAction, ...]) -> None:
        members = []
        for rank, a in group:
            ready = self.ready_time(rank, a)
            assert ready is not None  # waiting_partner checked it
            members.append((rank, a, ready))
        by_member = group_step or (lambda ms: [step(rank, a, ready) for rank, a, ready in ms])
        times = by_member(members)
        for (rank, a, _), t in zip(members, times):
            self._advance(rank, a, t)
