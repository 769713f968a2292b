"""The pipeline schedule IR: per-rank tuples of frozen, hashable actions.

One ``Schedule`` value is what the generators produce, the validator checks, the lowering passes
rewrite, the simulator times and the runtime interpreter executes.

Action strings: ``[chunk]KIND<microbatch>.<slice>``, the chunk prefix omitted for chunk 0.
``F3.2`` is the forward of microbatch 3, slice 2 on the rank's chunk 0; ``1B0.7`` the backward of
microbatch 0, slice 7 on chunk 1; ``SEND_F3.2`` sends F3.2's output to the next stage.

Stages: with ``pp`` ranks and ``vpp`` chunks per rank, chunk ``c`` of rank ``r`` is global stage
``c * pp + r`` (Megatron's interleaved layout), so stage ``s`` feeds stage ``s + 1``.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from enum import Enum
from functools import cached_property
from typing import Iterable, Iterator


class Kind(str, Enum):
    F = "F"  # forward
    B = "B"  # full backward (input and weight gradients)
    I = "I"  # backward, input gradient only  # noqa: E741
    W = "W"  # backward, weight gradient only
    SEND_F = "SEND_F"  # send activations to the next stage
    RECV_F = "RECV_F"  # receive activations from the previous stage
    SEND_B = "SEND_B"  # send input gradients to the previous stage
    RECV_B = "RECV_B"  # receive output gradients from the next stage

    def __str__(self) -> str:
        return self.value

    @property
    def is_compute(self) -> bool:
        return self in (Kind.F, Kind.B, Kind.I, Kind.W)

    @property
    def is_backward(self) -> bool:
        return self in (Kind.B, Kind.I, Kind.W)


EXCHANGE_MARK = "# exchange"  # in ``to_text``: the pairing's lines follow

_ACTION_RE = re.compile(r"^(\d*)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)\.(\d+)$")


@dataclass(frozen=True, order=True)
class Action:
    kind: Kind
    chunk: int
    microbatch: int
    slice: int = 0

    def __str__(self) -> str:
        prefix = str(self.chunk) if self.chunk else ""
        return f"{prefix}{self.kind.value}{self.microbatch}.{self.slice}"

    @classmethod
    def parse(cls, text: str) -> "Action":
        match = _ACTION_RE.match(text.strip())
        if not match:
            raise ValueError(
                f"action {text!r}: expected [chunk]KIND<microbatch>.<slice> with KIND one of "
                f"{', '.join(k.value for k in Kind)} (e.g. F3.2, 1B0.7, SEND_F3.2)"
            )
        chunk, kind, mb, sl = match.groups()
        return cls(Kind(kind), int(chunk or 0), int(mb), int(sl))

    def with_kind(self, kind: Kind) -> "Action":
        return Action(kind, self.chunk, self.microbatch, self.slice)

    @property
    def unit(self) -> tuple[int, int, int]:
        """(chunk, microbatch, slice): what this action works on, whatever its kind."""
        return (self.chunk, self.microbatch, self.slice)


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: ``ranks[r]`` is the ordered tuple of actions rank ``r`` executes.
    ``forward_only``: forwards alone (evaluation), as ``lower.forward_only`` derives them."""

    kind: str
    pp: int
    vpp: int
    num_microbatches: int
    num_slices: int
    ranks: tuple[tuple[Action, ...], ...]
    forward_only: bool = False
    # context exchange pairing in ``exchange_blocks.ExchangePlan`` text form ("": none). Lowering
    # passes rebuild the rows and drop it: a pairing names actions of one exact schedule.
    exchange: str = ""

    def __post_init__(self) -> None:
        if len(self.ranks) != self.pp:
            raise ValueError(f"schedule has {len(self.ranks)} rank rows for pp={self.pp}")

    @property
    def num_stages(self) -> int:
        return self.pp * self.vpp

    def stage(self, rank: int, chunk: int) -> int:
        return chunk * self.pp + rank

    def placement(self, stage: int) -> tuple[int, int]:
        """(rank, chunk) holding global ``stage``."""
        return stage % self.pp, stage // self.pp

    @cached_property
    def has_communication(self) -> bool:
        """Any ``SEND_*``/``RECV_*`` action."""
        return any(not a.kind.is_compute for row in self.ranks for a in row)

    @cached_property
    def is_lowered(self) -> bool:
        """Ready to execute: every message between ranks is an explicit action. With ``pp=1`` all
        stages sit on one rank and there are no messages, so such a schedule is lowered as generated."""
        return self.pp == 1 or self.has_communication

    @cached_property
    def has_split_backward(self) -> bool:
        return any(a.kind in (Kind.I, Kind.W) for row in self.ranks for a in row)

    def compute_actions(self, rank: int) -> Iterator[Action]:
        return (a for a in self.ranks[rank] if a.kind.is_compute)

    def replace_ranks(self, ranks: Iterable[Iterable[Action]]) -> "Schedule":
        return Schedule(
            self.kind,
            self.pp,
            self.vpp,
            self.num_microbatches,
            self.num_slices,
            tuple(tuple(row) for row in ranks),
            self.forward_only,
        )

    def to_text(self) -> str:
        """One line per rank, actions comma-separated; ``from_text`` reads it back."""
        header = (
            f"# kind={self.kind} pp={self.pp} vpp={self.vpp} "
            f"microbatches={self.num_microbatches} slices={self.num_slices}"
            + (" forward_only=1" if self.forward_only else "")
        )
        rows = [",".join(str(a) for a in row) for row in self.ranks]
        pairing = [EXCHANGE_MARK, *self.exchange.strip().splitlines()] if self.exchange else []
        return "\n".join([header, *rows, *pairing]) + "\n"

    @classmethod
    def from_text(cls, text: str) -> "Schedule":
        lines = [ln for ln in text.strip().splitlines() if ln.strip()]
        exchange = ""
        if EXCHANGE_MARK in lines:
            at = lines.index(EXCHANGE_MARK)
            lines, exchange = lines[:at], "\n".join(lines[at + 1 :]) + "\n"
        if not lines or not lines[0].startswith("#"):
            raise ValueError("schedule text must start with a '# kind=... pp=...' header line")
        meta = dict(tok.split("=", 1) for tok in lines[0][1:].split())
        rows = tuple(tuple(Action.parse(t) for t in ln.split(",") if t.strip()) for ln in lines[1:])
        return cls(
            meta["kind"],
            int(meta["pp"]),
            int(meta["vpp"]),
            int(meta["microbatches"]),
            int(meta["slices"]),
            rows,
            meta.get("forward_only") == "1",
            exchange,
        )

    def digest(self) -> str:
        """Content hash that ranks compare to agree on the plan."""
        return self._digest

    @cached_property
    def _digest(self) -> str:  # a schedule is immutable: a 100K-action text is hashed once, not every step
        return hashlib.sha256(self.to_text().encode()).hexdigest()[:16]
