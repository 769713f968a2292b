"""The context-exchange plan as a value: which compute actions serve attention blocks for which.

A block couples one compute action of a *sender* with one of a *taker* on another rank. The
sender's slice attends causally to its K/V prefix; the block is the part of that prefix in token
range ``[kv_start, kv_end)`` (positions in the sender's sequence, oldest first), which precedes
the slice, so the block is unmasked. The taker computes it and returns ``(out, lse)`` (a forward
sender) or ``(dQ, dK, dV)`` (a backward sender: it ships ``(q, out, lse, dout)`` and the K/V rows).
The block keeps its sender's pass: a taker may be in the other pass (a forward serves a backward
block and the reverse). ``W`` actions have no attention and never take part.

Rules every plan keeps (``ExchangePlan`` refuses the rest):

* an action is a sender or a taker, never both;
* a sender's blocks cover ``[0, m)`` without gaps or overlaps (its *moved* tokens): what it keeps
  is the rest of its prefix and the slice itself, so its own attention stays one contiguous range;
* a taker serves its blocks in the plan's order (the order of ``blocks``).

``step`` labels the group of actions that formed the blocks; the actions linked by blocks run as
one rendezvous (``groups``). A mirrored pair of the same pass is one block ``[0, moved)``.

Text form, one block a line: ``step sender sender_action taker taker_action kv_start kv_end``,
e.g. ``41 5 1F2.9 2 3B1.1 0 24576``. It rides in ``Schedule.exchange`` and so in its digest.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from functools import cached_property
from typing import Iterable

from megatron_slim.plan.schedule.ir import Action, Kind

RankAction = tuple[int, Action]
_FIELDS = "'step sender sender_action taker taker_action kv_start kv_end'"


@dataclass(frozen=True, order=True)
class ExchangeBlock:
    step: int
    sender: int
    sender_action: Action
    taker: int
    taker_action: Action
    kv_start: int
    kv_end: int

    def __post_init__(self) -> None:
        if self.sender == self.taker:
            raise ValueError(f"exchange block {self}: sender and taker are both rank {self.sender}")
        if not 0 <= self.kv_start < self.kv_end:
            raise ValueError(f"exchange block {self}: needs 0 <= kv_start < kv_end")
        if Kind.W in (self.sender_action.kind, self.taker_action.kind):
            raise ValueError(f"exchange block {self}: a W action has no attention to exchange")
        if not (self.sender_action.kind.is_compute and self.taker_action.kind.is_compute):
            raise ValueError(f"exchange block {self}: both ends must be compute actions")

    @property
    def tokens(self) -> int:
        """K/V tokens of the sender's prefix the taker attends to."""
        return self.kv_end - self.kv_start

    @property
    def backward(self) -> bool:
        """The block's pass: its sender's."""
        return self.sender_action.kind.is_backward

    @property
    def sender_end(self) -> RankAction:
        return (self.sender, self.sender_action)

    @property
    def taker_end(self) -> RankAction:
        return (self.taker, self.taker_action)

    def __str__(self) -> str:
        return (
            f"{self.step} {self.sender} {self.sender_action} {self.taker} {self.taker_action} "
            f"{self.kv_start} {self.kv_end}"
        )

    @classmethod
    def parse(cls, line: str) -> "ExchangeBlock":
        fields = line.split()
        if len(fields) != 7:
            raise ValueError(f"exchange block {line!r}: expected {_FIELDS}")
        step, sender, s_action, taker, t_action, start, end = fields
        s_act, t_act = Action.parse(s_action), Action.parse(t_action)
        return cls(int(step), int(sender), s_act, int(taker), t_act, int(start), int(end))


@dataclass(frozen=True)
class ExchangePlan:
    blocks: tuple[ExchangeBlock, ...] = ()

    def __post_init__(self) -> None:
        senders = {b.sender_end for b in self.blocks}
        both = senders & {b.taker_end for b in self.blocks}
        if both:
            rank, action = min(both)
            raise ValueError(f"exchange: {action} on rank {rank} is both a sender and a taker")
        for (rank, action), blocks in self.sent.items():
            ranges = sorted((b.kv_start, b.kv_end) for b in blocks)
            if ranges[0][0] != 0 or any(a[1] != b[0] for a, b in zip(ranges, ranges[1:])):
                raise ValueError(
                    f"exchange: the blocks of {action} on rank {rank} must cover [0, m) without gaps or "
                    f"overlaps; got {ranges}"
                )

    def to_text(self) -> str:
        """The text form; ``from_text`` of it answers this plan without parsing it again."""
        text = "".join(f"{b}\n" for b in self.blocks)
        _remember(text, self)
        return text

    @classmethod
    def from_text(cls, text: str) -> "ExchangePlan":
        """Parsed once per text (the walk, the validator and the simulator each read a plan)."""
        return _parsed(text)

    @cached_property
    def sent(self) -> dict[RankAction, tuple[ExchangeBlock, ...]]:
        """Each sender action's blocks, in plan order."""
        out: dict[RankAction, list[ExchangeBlock]] = {}
        for b in self.blocks:
            out.setdefault(b.sender_end, []).append(b)
        return {k: tuple(v) for k, v in out.items()}

    @cached_property
    def served(self) -> dict[RankAction, tuple[ExchangeBlock, ...]]:
        """Each taker action's blocks, in the order it serves them (plan order)."""
        out: dict[RankAction, list[ExchangeBlock]] = {}
        for b in self.blocks:
            out.setdefault(b.taker_end, []).append(b)
        return {k: tuple(v) for k, v in out.items()}

    @cached_property
    def _order(self) -> dict[ExchangeBlock, int]:
        return {b: i for i, b in enumerate(self.blocks)}

    def blocks_among(self, senders: Iterable[RankAction]) -> list[ExchangeBlock]:
        """The blocks sent by any of ``senders`` ((rank, action) pairs), in plan order."""
        found = [b for end in senders for b in self.sent.get(end, ())]
        return sorted(found, key=self._order.__getitem__)

    def moved_tokens(self, rank: int, action: Action) -> int:
        """``m``: the oldest tokens of ``action``'s prefix its takers attend to (0: not a sender)."""
        return max((b.kv_end for b in self.sent.get((rank, action), ())), default=0)

    @cached_property
    def groups(self) -> dict[RankAction, tuple[RankAction, ...]]:
        """Every action in a block -> all actions linked to it by blocks (itself included), sorted:
        they run as one rendezvous (each block's two ends meet at every attention layer)."""
        parent: dict[RankAction, RankAction] = {}

        def root(x: RankAction) -> RankAction:
            while parent.setdefault(x, x) != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        for b in self.blocks:
            parent[root(b.sender_end)] = root(b.taker_end)
        members: dict[RankAction, list[RankAction]] = {}
        for x in list(parent):
            members.setdefault(root(x), []).append(x)
        sorted_groups = [tuple(sorted(group)) for group in members.values()]  # one tuple a group, shared
        return {x: group for group in sorted_groups for x in group}

    def group_of(self, rank: int, action: Action) -> tuple[RankAction, ...]:
        """The rendezvous ``action`` on ``rank`` belongs to; empty when it exchanges nothing."""
        return self.groups.get((rank, action), ())

    def without(self, dropped: set[ExchangeBlock]) -> "ExchangePlan":
        """The plan less ``dropped`` blocks; a sender that loses a block keeps only a prefix
        ``[0, k)`` of its ranges (the rule above), so its blocks from the first gap on go too."""
        kept = [b for b in self.blocks if b not in dropped]
        cut: dict[RankAction, int] = {}
        for end, blocks in ExchangePlan._by_sender(kept).items():
            reach = 0
            for start, stop in sorted((b.kv_start, b.kv_end) for b in blocks):
                if start != reach:
                    break
                reach = stop
            cut[end] = reach
        return ExchangePlan(tuple(b for b in kept if b.kv_end <= cut[b.sender_end]))

    @staticmethod
    def _by_sender(blocks: list[ExchangeBlock]) -> dict[RankAction, list[ExchangeBlock]]:
        out: dict[RankAction, list[ExchangeBlock]] = {}
        for b in blocks:
            out.setdefault(b.sender_end, []).append(b)
        return out


_PLANS: dict[str, ExchangePlan] = {}  # text -> plan, the most recent last
_PLANS_KEPT = 16
_PLANS_LOCK = threading.Lock()  # the runtime may read plans from more than one thread


def _remember(text: str, plan: ExchangePlan) -> None:
    with _PLANS_LOCK:
        _PLANS.pop(text, None)
        _PLANS[text] = plan
        while len(_PLANS) > _PLANS_KEPT:
            del _PLANS[next(iter(_PLANS))]


def _parsed(text: str) -> ExchangePlan:
    with _PLANS_LOCK:
        plan = _PLANS.get(text)
    if plan is None:
        plan = ExchangePlan(tuple(ExchangeBlock.parse(ln) for ln in text.splitlines() if ln.strip()))
    _remember(text, plan)
    return plan
