"""Hand-built context-exchange block plans on a lowered SlimPipe schedule (pure: no torch).

The groups are found on the unit timeline (``exchange.unit_timeline``): actions that start at the
same moment co-run, so linking them by blocks keeps the readiness walk's rendezvous satisfiable.
Three moments are used, each with four members (one per rank of pp4):

* four forwards: the longest prefix splits ``[0, m)`` over the two shortest-prefix members at a
  boundary inside a cached slice (and ``m`` itself inside one), the second longest sends its block
  to the shortest too, which so serves two senders;
* two forwards and two backwards: the longest backward sends to a forward taker and the longest
  forward to a backward taker (cross-pass blocks both ways);
* four backwards: the longest splits over the two shortest, as the first moment.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from megatron_slim.plan.schedule.exchange import unit_timeline
from megatron_slim.plan.schedule.exchange_blocks import ExchangeBlock, ExchangePlan
from megatron_slim.plan.schedule.ir import Kind, Schedule


def _moments(schedule: Schedule) -> list[list]:
    slots: dict[float, list] = defaultdict(list)
    for (rank, a), (start, _) in unit_timeline(schedule).items():
        if a.kind is not Kind.W:
            slots[start].append((rank, a))
    return [sorted(members, key=lambda m: -m[1].slice) for _, members in sorted(slots.items())]


def _first(moments: list[list], forwards: int, pp: int) -> list:
    for members in moments:
        kinds = [a.kind.is_backward for _, a in members]
        if len(members) == pp and kinds.count(False) == forwards and all(a.slice > 0 for _, a in members[:2]):
            return members
    raise AssertionError(f"no moment with {forwards} forwards among {pp} members")


def _split(step: int, members: list, length: int, cut: int, trim: int) -> list[ExchangeBlock]:
    (s_rank, s_act), (r2, a2), (r3, a3), (r4, a4) = members
    prefix = s_act.slice * length
    moved = prefix - trim
    blocks = [
        ExchangeBlock(step, s_rank, s_act, r4, a4, 0, cut),
        ExchangeBlock(step, s_rank, s_act, r3, a3, cut, moved),
    ]
    if not a2.kind.is_backward:  # the second sender: the shortest member serves two
        blocks.append(ExchangeBlock(step, r2, a2, r4, a4, 0, a2.slice * length - trim))
    return blocks


def _cross(step: int, members: list, length: int, trim: int) -> list[ExchangeBlock]:
    forwards = [m for m in members if not m[1].kind.is_backward]
    backwards = [m for m in members if m[1].kind.is_backward]
    blocks = []
    for (s_rank, s_act), (t_rank, t_act) in ((backwards[0], forwards[-1]), (forwards[0], backwards[-1])):
        blocks.append(ExchangeBlock(step, s_rank, s_act, t_rank, t_act, 0, s_act.slice * length - trim))
    return blocks


def block_plan(schedule: Schedule, length: int, cut: int = 0, trim: int = 0) -> ExchangePlan:
    """The plan above for uniform slices of ``length`` tokens (pp4): a split sender's blocks are
    ``[0, cut)`` and ``[cut, prefix - trim)``, every other block ``[0, prefix - trim)`` (defaults:
    ``length // 2`` and ``length // 4``)."""
    moments, pp = _moments(schedule), schedule.pp
    cut, trim = cut or length // 2, trim or length // 4
    blocks = _split(0, _first(moments, pp, pp), length, cut, trim)
    blocks += _cross(1, _first(moments, 2, pp), length, trim)
    blocks += _split(2, _first(moments, 0, pp), length, cut, trim)
    return ExchangePlan(tuple(blocks))


def with_blocks(schedule: Schedule, length: int, cut: int = 0, trim: int = 0) -> Schedule:
    return dataclasses.replace(schedule, exchange=block_plan(schedule, length, cut, trim).to_text())
