"""Lowering passes, each ``Schedule -> Schedule``.

* ``add_communication``: a ``SEND_*`` right after each compute whose result another rank needs,
  a ``RECV_*`` right before each compute that needs another rank's result. A RECV marks where the
  rank waits; the runtime may post the receive earlier.
* ``split_backward`` / ``merge_backward``: ``B`` <-> ``I`` followed by ``W``.
* ``forward_only``: the forwards and their messages alone (evaluation), in the training order.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron_slim.plan.progress import Progress, report
from megatron_slim.plan.schedule.ir import Action, Kind, Schedule


def _actions(schedule: Schedule) -> int:
    return sum(len(row) for row in schedule.ranks)


def add_communication(schedule: Schedule, progress: Optional[Progress] = None) -> Schedule:
    """With ``pp=1`` there is no stage boundary between ranks: the schedule comes back unchanged.
    ``progress("adding communication", actions done, actions)`` after every rank."""
    if schedule.has_communication:
        raise ValueError("add_communication: schedule already has SEND/RECV actions")
    last = schedule.num_stages - 1
    rows = []
    for rank, actions in enumerate(schedule.ranks):
        row: list[Action] = []
        for a in actions:
            stage = schedule.stage(rank, a.chunk)
            prev_remote = stage > 0 and schedule.placement(stage - 1)[0] != rank
            next_remote = stage < last and schedule.placement(stage + 1)[0] != rank
            if a.kind is Kind.F:
                if prev_remote:
                    row.append(a.with_kind(Kind.RECV_F))
                row.append(a)
                if next_remote:
                    row.append(a.with_kind(Kind.SEND_F))
            elif a.kind in (Kind.B, Kind.I):
                if next_remote:
                    row.append(a.with_kind(Kind.RECV_B))
                row.append(a)
                if prev_remote:
                    row.append(a.with_kind(Kind.SEND_B))
            else:
                row.append(a)
        rows.append(row)
        report(progress, "adding communication", sum(map(len, schedule.ranks[: rank + 1])), _actions(schedule))
    return schedule.replace_ranks(rows)


def strip_communication(schedule: Schedule) -> Schedule:
    return schedule.replace_ranks([a for a in row if a.kind.is_compute] for row in schedule.ranks)


def forward_only(schedule: Schedule) -> Schedule:
    """Drop every backward action and gradient message. Applied to a lowered schedule, each link
    keeps its forward messages in the order it sent them, so the result is as NCCL-safe as its input."""
    forwards = (Kind.F, Kind.SEND_F, Kind.RECV_F)
    return dataclasses.replace(
        schedule.replace_ranks([a for a in row if a.kind in forwards] for row in schedule.ranks), forward_only=True
    )


def split_backward(schedule: Schedule) -> Schedule:
    """Each ``B`` becomes ``I`` (input gradient, unblocks the previous stage) then ``W``."""
    rows = []
    for row in schedule.ranks:
        out: list[Action] = []
        for a in row:
            if a.kind is Kind.B:
                out += [a.with_kind(Kind.I), a.with_kind(Kind.W)]
            else:
                out.append(a)
        rows.append(out)
    return schedule.replace_ranks(rows)


def merge_backward(schedule: Schedule) -> Schedule:
    """An ``I`` whose ``W`` follows it directly (communication aside) becomes one ``B``."""
    rows = []
    for row in schedule.ranks:
        out: list[Action] = []
        pending: dict[tuple[int, int, int], int] = {}
        for a in row:
            if a.kind is Kind.I:
                pending[a.unit] = len(out)
                out.append(a)
            elif (
                a.kind is Kind.W
                and a.unit in pending
                and all(not x.kind.is_compute for x in out[pending[a.unit] + 1 :])
            ):
                out[pending.pop(a.unit)] = a.with_kind(Kind.B)
            else:
                out.append(a)
        rows.append(out)
    return schedule.replace_ranks(rows)


def order_receives_by_link(schedule: Schedule, progress: Optional[Progress] = None) -> Schedule:
    """Move receives earlier so each directed link is received in the order it is sent.

    NCCL pairs a link's point-to-point operations in posting order. Where a rank would receive two
    messages of one link in another order than the peer sends them (pp=2 with interleaving: one
    link carries activations and gradients), the later-needed message's RECV moves up to the slot
    of the earlier one. Only receives move, and only earlier; validate the result for deadlocks.
    ``progress("ordering receives", actions done, actions)`` after every rank.
    """
    if not schedule.is_lowered:
        raise ValueError("order_receives_by_link: lower the schedule with add_communication first")
    send_order: dict[tuple[int, int], list[Action]] = {}
    for rank, actions in enumerate(schedule.ranks):
        for a in actions:
            if a.kind in (Kind.SEND_F, Kind.SEND_B):
                stage = schedule.stage(rank, a.chunk)
                dst_stage = stage + 1 if a.kind is Kind.SEND_F else stage - 1
                dst, dst_chunk = schedule.placement(dst_stage)
                recv = Action(Kind.RECV_F if a.kind is Kind.SEND_F else Kind.RECV_B, dst_chunk, a.microbatch, a.slice)
                send_order.setdefault((rank, dst), []).append(recv)
    rows = []
    for rank, row_actions in enumerate(schedule.ranks):
        row: list[Action] = list(row_actions)
        for (_src, dst), messages in send_order.items():
            if dst != rank:
                continue
            incoming = set(messages)  # once per link: building it per action made the pass quadratic
            position = {a: i for i, a in enumerate(row) if a in incoming}
            slots = [position[m] for m in messages]
            wanted = slots[:]
            for k in range(len(wanted) - 2, -1, -1):  # suffix minimum: positions rise in send order
                wanted[k] = min(wanted[k], wanted[k + 1])
            if wanted == slots:
                continue
            # sort key: a receive moved to slot w goes right before whatever held slot w, in send order
            keys = {a: (i, 1, 0) for i, a in enumerate(row)}
            for k, (m, w) in enumerate(zip(messages, wanted)):
                keys[m] = (w, 0, k)
            row = sorted(row, key=keys.__getitem__)
        rows.append(row)
        report(progress, "ordering receives", sum(map(len, schedule.ranks[: rank + 1])), _actions(schedule))
    return schedule.replace_ranks(rows)


def lower(schedule: Schedule, progress: Optional[Progress] = None) -> Schedule:
    """The lowering both the simulator and the runtime execute: communication added, receives
    ordered per link (safe for NCCL as well as gloo)."""
    return order_receives_by_link(add_communication(schedule, progress), progress)
