"""What ``megatron-slim train`` packs each iteration (``data.packing``): documents -> samples ->
a packing plan -> per DP rank, windows of exactly ``seq_length`` tokens.

* A document longer than ``seq_length`` is first cut into ``seq_length``-token samples (as
  Megatron's ``GPTDataset`` cuts its stream): the runtime keeps a document's K/V only inside one
  microbatch, so no sample may be cut across MicroPacks or DP ranks. SlimPack is asked for whole
  samples (phase 1 only: phase 2's time budget would make the plan depend on each rank's timing);
  a plan that still cuts one is refused. Given a ``CPRoute`` (``cp.engine: zeppelin``), SlimPack
  CP-routes the outliers that fill a window (DP-merge being unavailable under CP; without CP, where the
  run can execute it, ``merge_slices`` offers DP-merge, ``dp_merge.py``); ``cp_routed_windows`` names
  each replica's routed windows for the runtime (``train/packed_routes.py``).
* Iteration ``i`` takes the next samples of the corpus order, as many as fit in
  ``global_batch_size * seq_length`` tokens (so between that less ``seq_length`` and that), the
  same ones whatever the method, so runs are comparable; the corpus wraps around when it runs out.
* Each MicroPack becomes one window (b=1): its pieces concatenated, padded at the end. A DP rank
  without any MicroPack runs one window of padding only, so every rank runs the schedule.
* Loss tokens: every position whose next token is in the same document (a document's last
  token predicts nothing), so every token but a document's first is a label exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from megatron_slim.plan.pack.baselines import plan_baseline
from megatron_slim.plan.pack.costs import SliceCosts
from megatron_slim.plan.pack.cp_route import CPRoute
from megatron_slim.plan.pack.dp_merge import MergeTransfer, Step, check_merge_order, merge_transfers
from megatron_slim.plan.pack.plan import PackingPlan, Piece
from megatron_slim.plan.pack.slimpack import solve
from megatron_slim.plan.schedule.generators import slimpipe
from megatron_slim.plan.schema import ConfigError, fail

TRAIN_PACKING = ("none", "slimpack", "megatron", "bfd")


@dataclass(frozen=True)
class Sample:
    """Tokens ``[offset, offset + length)`` of document ``document`` (an index into the corpus)."""

    document: int
    offset: int
    length: int
    last: bool  # holds its document's last token (which has no label)

    @property
    def loss_tokens(self) -> int:
        return self.length - 1 if self.last else self.length


def iteration_samples(sample_lengths: Sequence[int], budget: int, iteration: int) -> list[int]:
    """The samples (indices into ``sample_lengths``) of 0-based ``iteration``: from where the
    previous iteration stopped, while their tokens fit ``budget`` (at least one, none twice)."""
    if budget < 1 or not sample_lengths:
        raise fail("packing budget", budget, "an integer >= 1 and at least one sample")
    n, cursor = len(sample_lengths), 0
    for it in range(iteration + 1):
        taken: list[int] = []
        total = 0
        while not taken or (len(taken) < n and total + sample_lengths[cursor % n] <= budget):
            taken.append(cursor % n)
            total += sample_lengths[cursor % n]
            cursor += 1
        if it == iteration:
            return taken
    raise AssertionError("unreachable")


def cut_samples(documents: Sequence[int], document_lengths: Sequence[int], seq_length: int) -> tuple[Sample, ...]:
    """``documents`` in samples of at most ``seq_length`` tokens, in order."""
    samples = []
    for d in documents:
        length = document_lengths[d]
        for offset in range(0, length, seq_length):
            n = min(seq_length, length - offset)
            samples.append(Sample(d, offset, n, offset + n == length))
    return tuple(samples)


def plan_samples(
    method: str,
    samples: Sequence[Sample],
    costs: SliceCosts,
    dp: int,
    seq_length: int,
    cp_route: Optional[CPRoute] = None,
    dp_merge: bool = False,
) -> PackingPlan:
    """The plan of ``method`` (one of ``TRAIN_PACKING`` but none) for ``samples`` over ``dp`` ranks,
    MicroPack cap ``seq_length``; refused if it cuts a sample across MicroPacks. ``cp_route``
    (slimpack only): outliers that fill a window are CP-routed (``solve``'s ``whole_samples``);
    ``dp_merge`` (slimpack only): an outlier may be split in two over two DP ranks (``dp_merge.py``)."""
    lengths = [s.length for s in samples]
    if method == "slimpack":
        merge = dp_merge and cp_route is None
        plan = solve(
            lengths, costs, dp, seq_length, budget_s=0.0, whole_samples=True, cp_route=cp_route, dp_merge=merge
        ).plan
    elif method in TRAIN_PACKING[2:]:
        plan = plan_baseline(method, lengths, costs, dp, seq_length)
    else:
        raise fail("data.packing", method, ", ".join(TRAIN_PACKING[1:]) + " (for a packed iteration)")
    _refuse_cut_samples(plan, dp_merge and method == "slimpack")
    return plan


def _refuse_cut_samples(plan: PackingPlan, across_ranks: bool = False) -> None:
    """``across_ranks``: a sample may sit on several DP ranks (DP-merge), in one MicroPack of each."""
    where: dict[tuple[int, int], tuple[int, int]] = {}
    for r, packs in enumerate(plan.ranks):
        for m, pack in enumerate(packs):
            for p in pack.pieces:
                key = (p.sample, r if across_ranks else 0)
                if where.setdefault(key, (r, m)) != (r, m):
                    raise ConfigError(
                        f"data.packing={plan.method}: sample {p.sample} is cut across MicroPacks "
                        f"{where[key]} and {(r, m)} (rank, index); the runtime keeps a document's K/V "
                        "within one microbatch (allowed: plans that keep every sample in one MicroPack)"
                    )


@dataclass(frozen=True)
class Window:
    """One microbatch: ``pieces`` of samples back to back, then ``padding`` tokens."""

    pieces: tuple[Piece, ...]
    padding: int

    @property
    def document_lengths(self) -> tuple[int, ...]:
        """Its documents' lengths in order (a sample's adjacent pieces as one), padding last."""
        lengths: list[int] = []
        previous = None
        for p in self.pieces:
            if previous is not None and p.sample == previous.sample and p.start == previous.start + previous.length:
                lengths[-1] += p.length
            else:
                lengths.append(p.length)
            previous = p
        return tuple(lengths) + ((self.padding,) if self.padding else ())


def rank_windows(plan: PackingPlan, rank: int, seq_length: int) -> tuple[Window, ...]:
    """DP rank ``rank``'s windows in pipeline order (one of padding only when it has no MicroPack)."""
    packs = plan.ranks[rank]
    if not packs:
        return (Window((), seq_length),)
    return tuple(Window(tuple(sorted(m.pieces, key=plan_order(m.pieces))), seq_length - m.tokens) for m in packs)


def plan_order(pieces: Sequence[Piece]) -> Callable[[Piece], tuple[int, int]]:
    """Pieces keep the MicroPack's order, except that one sample's pieces run in start order."""
    first: dict[int, int] = {}
    for i, p in enumerate(pieces):
        first.setdefault(p.sample, i)
    return lambda p: (first[p.sample], p.start)


@dataclass(frozen=True)
class IterationPacking:
    """Everything about one packed iteration that every rank computes alike."""

    method: str
    samples: tuple[Sample, ...]
    plan: PackingPlan
    windows: tuple[tuple[Window, ...], ...]  # per DP rank
    merges: tuple[MergeTransfer, ...] = ()  # DP-merged samples (``dp_merge.py``)

    @property
    def loss_tokens(self) -> int:
        return sum(s.loss_tokens for s in self.samples)

    @property
    def document_tokens(self) -> int:
        return sum(s.length for s in self.samples)

    def padding_share(self) -> float:
        total = sum(w.padding + sum(p.length for p in w.pieces) for ws in self.windows for w in ws)
        return 1.0 - self.document_tokens / total

    def record(self) -> dict[str, Any]:
        """The iteration's packing in plain values (``megatron-slim train --json``)."""
        return {
            "method": self.method,
            "microbatches": [len(ws) for ws in self.windows],
            "padding_share": self.padding_share(),
            "document_tokens": self.document_tokens,
            "loss_tokens": self.loss_tokens,
            "summary": self.summary(),
            **({"cp_routed": sorted(self.plan.cp_routed())} if self.plan.routes else {}),
            **({"dp_merged": [t.sample for t in self.merges]} if self.merges else {}),
        }

    def summary(self) -> str:
        counts = "/".join(str(len(ws)) for ws in self.windows)
        text = f"packing {self.method}: {counts} microbatches per DP rank, padding {100 * self.padding_share():.1f}%"
        routed = len(self.plan.cp_routed())
        return (
            text
            + (f", {routed} CP-routed" if self.plan.routes else "")
            + (f", {len(self.merges)} DP-merged" if self.merges else "")
        )

    def cp_routed_windows(self, rank: int) -> dict[int, int]:
        """DP rank ``rank``'s windows that run a CP-routed sample: microbatch index -> the sample.
        Such a window holds that sample alone, without padding (refused otherwise)."""
        routed, out = self.plan.cp_routed(), {}
        for m, w in enumerate(self.windows[rank]):
            held = {p.sample for p in w.pieces}
            if held & routed:
                if len(held) > 1 or w.padding:
                    raise ConfigError(
                        f"data.packing={self.method}: CP-routed sample(s) {sorted(held & routed)} share window {m} "
                        f"of DP rank {rank} with samples {sorted(held - routed)} and {w.padding} padding tokens "
                        "(allowed: a CP-routed sample alone in a window it fills)"
                    )
                out[m] = held.pop()
        return out


def pack_iteration(
    method: str,
    samples: Sequence[Sample],
    costs: SliceCosts,
    dp: int,
    seq_length: int,
    cp_route: Optional[CPRoute] = None,
    merge_slices: Optional[Sequence[int]] = None,
) -> IterationPacking:
    """``merge_slices``: the SlimPipe slice lengths of a pp=1 run that can execute DP-merge; SlimPack
    may then split an outlier over two DP ranks, kept only if ``check_merge_order`` passes on the
    run's own schedule (else the iteration is planned again without DP-merge)."""
    samples = tuple(samples)
    if merge_slices is not None and method == "slimpack" and cp_route is None:
        plan = plan_samples(method, samples, costs, dp, seq_length, dp_merge=True)
        windows = tuple(rank_windows(plan, r, seq_length) for r in range(dp))
        merges = merge_transfers(plan, windows)
        try:
            check_merge_order(merges, [_slimpipe_steps(len(w), len(merge_slices)) for w in windows], merge_slices)
            return IterationPacking(method, samples, plan, windows, merges)
        except ConfigError:
            pass  # a deadlocking order: this iteration runs without DP-merge
    plan = plan_samples(method, samples, costs, dp, seq_length, cp_route)
    windows = tuple(rank_windows(plan, r, seq_length) for r in range(dp))
    return IterationPacking(method, samples, plan, windows)


def _slimpipe_steps(microbatches: int, slices: int) -> tuple[Step, ...]:
    """A pp=1 SlimPipe rank's compute actions in order (``plan/schedule/generators.slimpipe``)."""
    ranks = slimpipe(1, microbatches, slices).ranks
    return tuple((a.kind.value, a.microbatch, a.slice) for a in ranks[0] if a.kind.is_compute)
