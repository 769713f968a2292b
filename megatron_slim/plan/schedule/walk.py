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
from typing import Callable, Optional

from megatron_slim.plan.progress import EVERY, Progress, report
from megatron_slim.plan.schedule.exchange_blocks import ExchangePlan, RankAction
from megatron_slim.plan.schedule.facts import SEND_WINDOW, Fact, produced, required, window_waits
from megatron_slim.plan.schedule.facts import tables as facts_tables
from megatron_slim.plan.schedule.ir import Action, Schedule

__all__ = ["SEND_WINDOW", "Fact", "Walker", "bounded_sends", "describe", "produced", "required", "window_waits"]

Step = Callable[[int, Action, float], float]  # (rank, action, ready time) -> time its fact is available
# [(rank, action, ready)] of one exchange group -> each member's time, in the same order
GroupStep = Callable[[list[tuple[int, Action, float]]], list[float]]


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
        tables = facts_tables(schedule)
        self._tables = tables
        self.window = dict(tables.window)
        self._waits: list[list[Optional[Fact]]] = [
            [self.window.get((rank, a)) for a in row] for rank, row in enumerate(schedule.ranks)
        ]
        # position -> its exchange group, each member as (rank, the row's own action: `is` finds it)
        self._groups: list[dict[int, tuple[RankAction, ...]]] = [{} for _ in schedule.ranks]
        members: dict[int, tuple[RankAction, ...]] = {}  # one per group: it maps every member
        for (rank, a), group in self.exchange.groups.items():
            i = tables.index[rank].get(a)
            if i is not None:
                found = members.get(id(group))
                if found is None:
                    found = members[id(group)] = tuple(self._member(r, b) for r, b in group)
                self._groups[rank][i] = found

    def _member(self, rank: int, a: Action) -> RankAction:
        i = self._tables.index[rank].get(a)
        return (rank, a if i is None else self.schedule.ranks[rank][i])

    def requires(self, rank: int, a: Action) -> list[Fact]:
        """``required`` plus, for a send, the receive the send window waits for."""
        i = self._tables.index[rank][a]
        wait = self._waits[rank][i]
        facts = list(self._tables.required[rank][i])
        return facts if wait is None else facts + [wait]

    def waiting_partner(self, rank: int, a: Action) -> Optional[RankAction]:
        """A member of ``a``'s exchange group that is not next and ready on its rank, else None."""
        return self._first_waiting(self.exchange.group_of(rank, a))

    def _first_waiting(self, group: tuple[RankAction, ...]) -> Optional[RankAction]:
        rows, pos = self.schedule.ranks, self.pos
        for p_rank, p_action in group:
            row, at = rows[p_rank], pos[p_rank]
            at_head = at < len(row) and (row[at] is p_action or row[at] == p_action)
            if not (at_head and self._ready_at(p_rank, at) is not None):
                return (p_rank, p_action)
        return None

    def _ready_at(self, rank: int, i: int) -> Optional[float]:
        """``ready_time`` of the action at position ``i`` of ``rank``'s row, from the tables."""
        done = self.done
        t = 0.0
        for f in self._tables.required[rank][i]:
            at = done.get(f)
            if at is None:
                return None
            t = max(t, at)
        wait = self._waits[rank][i]
        if wait is not None:
            at = done.get(wait)
            if at is None:
                return None
            t = max(t, at)
        return t

    def _advance(self, rank: int, a: Action, t: float) -> None:
        self.done[produced(self.schedule, rank, a)] = t
        self.pos[rank] += 1

    def unmet(self, rank: int, a: Action) -> list[Fact]:
        return [f for f in self.requires(rank, a) if f not in self.done]

    def ready_time(self, rank: int, a: Action) -> Optional[float]:
        """Latest time among the facts ``a`` needs, or None while one is missing."""
        return self._ready_at(rank, self._tables.index[rank][a])

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
                    self._waits[rank][self.pos[rank]] = None
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
                groups, produced_at = self._groups[rank], self._tables.produced[rank]
                while self.pos[rank] < len(row):
                    i = self.pos[rank]
                    a = row[i]
                    ready = self._ready_at(rank, i)
                    group_at = groups.get(i)
                    if ready is None or (group_at is not None and self._first_waiting(group_at) is not None):
                        break
                    group = self.exchange.group_of(rank, a) if group_at is not None else ()
                    if not group:
                        self.done[produced_at[i]] = step(rank, a, ready)
                        self.pos[rank] += 1
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
