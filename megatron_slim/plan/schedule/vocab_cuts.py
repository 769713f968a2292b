"""Where every pipeline rank meets the vocabulary exchanges of ``schedule.vocab_parallel``: one
*cut* of the schedule per exchange (``plan/schedule/vocab.py`` says what each exchange is).

A cut gives each rank a position ``c`` of its row: the rank meets the exchange after its first
``c`` steps. Every exchange waits on every rank (the output layer's is a collective; at an
embedding lookup stage 0 waits for every rank and each rank for stage 0), so a set of exchanges
runs without any rank waiting forever when

* each cut is *closed*: whatever an action before the cut on one rank waits for (a compute's
  receive, a receive's send, a bounded send's earlier receive on its link, ``walk.window_waits``)
  lies before the cut on its own rank too; such prefixes are reached by every rank without any
  rank passing its cut, since the valid schedule runs them;
* the exchanges come in one order on every rank: along stage 0's order, every rank's positions
  never decrease (at one position a rank meets them in that order).

By induction every exchange is then met. Two kinds of cut, each as the schedule allows:

* the output exchange of microbatch ``m``: the *smallest* closed cut whose last-rank prefix holds
  the last stage's forward of ``m``'s last slice (the exchange reads its hidden states), so no rank
  joins later than it must and the last rank waits least; it must hold none of the last stage's
  backwards of ``m`` (they start from the exchange's gradients), else the schedule is refused;
* stage 0's lookup of slice ``(m, j)`` meets every rank inside its forward ``F(m, j)`` on its first
  chunk: the *greatest* closed cut with stage 0 at that step and every other rank at most at its
  ``RECV_F(m, j)`` on its first chunk (there it waits for stage 0's forward anyway, so serving costs
  it nothing). With one chunk per rank that bound is itself closed; with several, a rank may have to
  serve earlier, before waiting for a gradient stage 0 sends only after the forward.

Each kind's closure keeps the order: an output cut that passes a lookup on stage 0 is raised to hold
that lookup's cut, and a lookup's cut holds every output cut stage 0 passed before it (the greatest
closed cut does, a closed cut below its bounds being below it).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from megatron_slim.plan.schedule.ir import Action, Kind, Schedule
from megatron_slim.plan.schedule.walk import Fact, bounded_sends, produced, required, window_waits

Cut = tuple[int, ...]  # per rank: the steps run before the exchange
Slice = tuple[int, int]  # (microbatch, slice)


@dataclass(frozen=True)
class VocabCuts:
    """Every exchange's cut, in the order every rank meets them."""

    outputs: tuple[Cut, ...]  # per microbatch
    lookups: tuple[tuple[Slice, Cut], ...]  # stage 0's lookups in its order
    order: tuple[tuple[str, int], ...]  # ("out", microbatch) or ("emb", lookup index)


@functools.lru_cache(maxsize=16)  # every rank of a process asks for the same schedule's cuts
def vocab_cuts(schedule: Schedule) -> VocabCuts:
    """The cuts of ``schedule``; ``ValueError`` for a schedule that has none (see the module doc)."""
    finder = _CutFinder(schedule)
    outputs = tuple(finder.output(m) for m in range(schedule.num_microbatches))
    lookups = tuple((key, finder.lookup(k)) for k, key in enumerate(finder.slices))
    stage0 = [((cut[0], 0, m), ("out", m)) for m, cut in enumerate(outputs)]
    stage0 += [((cut[0], 1, k), ("emb", k)) for k, (_, cut) in enumerate(lookups)]
    order = tuple(event for _, event in sorted(stage0))
    cuts = VocabCuts(outputs, lookups, order)
    for rank in range(schedule.pp):
        positions = [cut_of(cuts, event)[rank] for event in order]
        if positions != sorted(positions):
            raise ValueError(
                f"schedule.vocab_parallel: rank {rank} would meet the vocabulary exchanges out of stage 0's "
                f"order; allowed: schedules whose exchanges every rank can meet in one order (1f1b, "
                f"interleaved, slimpipe as generated)"
            )
    return cuts


def cut_of(cuts: VocabCuts, event: tuple[str, int]) -> Cut:
    kind, index = event
    return cuts.outputs[index] if kind == "out" else cuts.lookups[index][1]


@dataclass
class _CutFinder:
    schedule: Schedule
    where: dict[Fact, tuple[int, int]] = field(init=False)  # fact -> (rank, step)
    needs: list[list[tuple[tuple[int, int], ...]]] = field(init=False)  # [rank][step] -> (rank, step) waited for
    slices: list[Slice] = field(init=False)  # stage 0's lookups, in its order
    found: dict[int, Cut] = field(init=False, default_factory=dict)  # lookup index -> cut
    done: list[Cut] = field(init=False, default_factory=list)  # output cuts so far

    def __post_init__(self) -> None:
        s = self.schedule
        self.where = {produced(s, r, a): (r, i) for r, row in enumerate(s.ranks) for i, a in enumerate(row)}
        window, bounded = window_waits(s), bounded_sends(s)

        def needs(r: int, a: Action) -> tuple[tuple[int, int], ...]:
            facts = required(s, r, a) + ([window[(r, a)]] if (r, a) in bounded else [])
            return tuple(self.where[f] for f in facts)

        self.needs = [[needs(r, a) for a in row] for r, row in enumerate(s.ranks)]
        self.slices = [(a.microbatch, a.slice) for a in s.ranks[0] if a.kind is Kind.F and a.chunk == 0]

    def _step(self, rank: int, kind: Kind, key: Slice, chunk: int = 0) -> int:
        return self.where[produced(self.schedule, rank, Action(kind, chunk, *key))][1]

    def output(self, m: int) -> Cut:
        """The smallest closed cut holding the last stage's forward of ``m``'s last slice."""
        s, last = self.schedule, self.schedule.pp - 1
        cut = list(self.done[-1]) if self.done else [0] * s.pp
        head = self._step(last, Kind.F, (m, s.num_slices - 1), s.vpp - 1)
        cut[last] = max(cut[last], head + 1)
        scanned = list(self.done[-1]) if self.done else [0] * s.pp  # a closed cut's prefixes need nothing more
        passed = 0  # stage 0's lookups inside its prefix, already raised to
        moved = True
        while moved:
            moved = False
            while passed < len(self.slices) and self._step(0, Kind.F, self.slices[passed]) < cut[0]:
                lookup = self.lookup(passed)
                moved |= any(c < b for c, b in zip(cut, lookup))
                cut = [max(c, b) for c, b in zip(cut, lookup)]
                passed += 1
            for r, needs in enumerate(self.needs):
                for i in range(scanned[r], cut[r]):
                    for q, step in needs[i]:
                        if cut[q] <= step:
                            cut[q], moved = step + 1, True
                scanned[r] = max(scanned[r], cut[r])
        backwards = [i for i, a in enumerate(s.ranks[last]) if a.kind.is_backward and a.chunk == s.vpp - 1]
        if any(s.ranks[last][i].microbatch == m for i in backwards if i < cut[last]):
            raise ValueError(
                f"schedule.vocab_parallel: rank {last} would join microbatch {m}'s output exchange after its "
                f"backward of {m}, which needs the exchange; allowed: 1f1b, interleaved, slimpipe as generated"
            )
        self.done.append(tuple(cut))
        return tuple(cut)

    def lookup(self, k: int) -> Cut:
        """The greatest closed cut with stage 0 at its forward of slice ``k`` and every other rank at
        most at its ``RECV_F`` of it (first chunks)."""
        if k in self.found:
            return self.found[k]
        s, key = self.schedule, self.slices[k]
        cut = [self._step(0, Kind.F, key)] + [self._step(r, Kind.RECV_F, key) for r in range(1, s.pp)]
        floor = list(self.lookup(k - 1)) if k else [0] * s.pp  # memoized: asked in order
        for output in self.done:  # output cuts stage 0 passes before this forward
            if output[0] <= cut[0]:
                floor = [max(f, o) for f, o in zip(floor, output)]
        moved = True
        while moved:
            moved = False
            for r, needs in enumerate(self.needs):
                for i in range(floor[r], cut[r]):
                    if any(step >= cut[q] for q, step in needs[i]):
                        cut[r], moved = i, True
                        break
        if cut[0] != self._step(0, Kind.F, key) or any(c < f for c, f in zip(cut, floor)):
            raise ValueError(
                f"schedule.vocab_parallel: no rank order lets stage 0 look up slice {key} with every rank; "
                f"allowed: 1f1b, interleaved, slimpipe as generated"
            )
        self.found[k] = tuple(cut)
        return self.found[k]
