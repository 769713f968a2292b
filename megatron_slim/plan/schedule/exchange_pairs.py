"""The context-exchange pairing as a value: which compute actions pair up, and what moves.

A pair couples one compute action of a *sender* (the rank whose slice has the longer K/V prefix)
with one of a *peer* on another rank, both forwards or both backwards. During the pair the sender
ships its slice's Q and the first ``moved_tokens`` tokens of its K/V prefix (whole slices, the
oldest ones) to the peer; the peer computes that non-causal attention block and returns
``(out, lse)``; the backward ships ``(q, out, lse, dout)`` and that K/V and gets ``(dQ, dK, dV)``
back. ``step`` labels the group that formed the pair (a step of the timeline the pairing read, or
a later idle-time round, ``plan/sim/exchange_slack.py``); it orders the plan and nothing else.

Text form, one pair a line: ``step sender sender_action peer peer_action moved_tokens``, e.g.
``41 5 1F2.9 2 3F1.1 24576``. It rides in ``Schedule.exchange`` and so in its digest.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from megatron_slim.plan.schedule.ir import Action

RankAction = tuple[int, Action]


@dataclass(frozen=True, order=True)
class ExchangePair:
    step: int
    sender: int
    sender_action: Action
    peer: int
    peer_action: Action
    moved_tokens: int

    def __post_init__(self) -> None:
        if self.sender == self.peer:
            raise ValueError(f"exchange pair {self}: sender and peer are both rank {self.sender}")
        if self.moved_tokens <= 0:
            raise ValueError(f"exchange pair {self}: moved_tokens must be positive")
        if self.sender_action.kind.is_backward != self.peer_action.kind.is_backward:
            raise ValueError(f"exchange pair {self}: pairs a forward with a backward")

    def __str__(self) -> str:
        return f"{self.step} {self.sender} {self.sender_action} {self.peer} {self.peer_action} {self.moved_tokens}"

    @classmethod
    def parse(cls, line: str) -> "ExchangePair":
        fields = line.split()
        if len(fields) != 6:
            raise ValueError(
                f"exchange pair {line!r}: expected 'step sender sender_action peer peer_action moved_tokens'"
            )
        step, sender, s_action, peer, p_action, moved = fields
        return cls(int(step), int(sender), Action.parse(s_action), int(peer), Action.parse(p_action), int(moved))


@dataclass(frozen=True)
class ExchangePlan:
    pairs: tuple[ExchangePair, ...] = ()

    def to_text(self) -> str:
        return "".join(f"{p}\n" for p in self.pairs)

    @classmethod
    def from_text(cls, text: str) -> "ExchangePlan":
        return cls(tuple(ExchangePair.parse(ln) for ln in text.splitlines() if ln.strip()))

    @cached_property
    def by_action(self) -> dict[RankAction, ExchangePair]:
        """Both ends of every pair; an action in two pairs is refused."""
        found: dict[RankAction, ExchangePair] = {}
        for p in self.pairs:
            for end in ((p.sender, p.sender_action), (p.peer, p.peer_action)):
                if end in found:
                    raise ValueError(f"exchange: {end[1]} on rank {end[0]} is in two pairs ({found[end]}; {p})")
                found[end] = p
        return found

    def partner(self, rank: int, action: Action) -> RankAction | None:
        """The other end of the pair ``action`` on ``rank`` belongs to, or None."""
        p = self.by_action.get((rank, action))
        if p is None:
            return None
        return (p.peer, p.peer_action) if (p.sender, p.sender_action) == (rank, action) else (p.sender, p.sender_action)
