"""The facts of the readiness walk (``walk.py``, whose docstring states the rules): what each
action produces and requires, and each send's window wait; and those of a schedule's rows as
tables by position, shared by every walk of the same rows."""

from __future__ import annotations

from typing import Any

from megatron_slim.plan.schedule.deps import compute_dependencies, key
from megatron_slim.plan.schedule.ir import Action, Kind, Schedule

Fact = tuple[Any, ...]  # a compute action's ``deps.Key``, or a comm fact (see ``walk.py``)

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


class Tables:
    """Per position of each rank's row: the fact its action produces, the facts it requires, the
    receive its send window waits for (None: none). They depend on the rows alone, so every walk of
    one schedule's rows (with any exchange plan) shares them."""

    def __init__(self, schedule: Schedule) -> None:
        self.ranks = schedule.ranks  # held: the cache is keyed by its id
        self.produced = [[produced(schedule, r, a) for a in row] for r, row in enumerate(schedule.ranks)]
        self.required = [[tuple(required(schedule, r, a)) for a in row] for r, row in enumerate(schedule.ranks)]
        self.window = window_waits(schedule)
        self.index = [{a: i for i, a in enumerate(row)} for row in schedule.ranks]


_TABLES: dict[tuple[int, ...], Tables] = {}
_TABLES_KEPT = 8


def tables(schedule: Schedule) -> Tables:
    """``Tables`` of ``schedule``'s rows, built once per rows object (and shape) among the last few."""
    s = schedule
    key = (id(s.ranks), s.pp, s.vpp, s.num_microbatches, s.num_slices, s.forward_only)
    tables = _TABLES.pop(key, None)
    if tables is None or tables.ranks is not s.ranks:
        tables = Tables(schedule)
    _TABLES[key] = tables  # most recent last
    while len(_TABLES) > _TABLES_KEPT:
        del _TABLES[next(iter(_TABLES))]
    return tables
