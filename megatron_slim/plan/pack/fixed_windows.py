"""Packed iterations of a fixed number of windows per DP rank, for Megatron-LM's own training loop.

Megatron runs exactly ``global_batch_size / (micro_batch_size * dp)`` microbatches per DP rank per
iteration (its sampler hands every rank the same count), whereas ``megatron-slim train`` lets the
count vary (``plan/pack/training.py``). Here each iteration therefore:

* takes the next samples of the corpus order while their tokens fit ``windows_per_rank * dp *
  seq_length`` (as ``megatron-slim train`` does with ``global_batch_size * seq_length``);
* packs them with the chosen method; while the plan gives some DP rank more MicroPacks than it may
  run, the last sample is handed back to the next iteration and the rest is packed again;
* fills a rank with fewer MicroPacks up to the count with all-padding windows (no loss tokens, so
  they add nothing to the loss or the gradients under per-token loss normalisation).

Iteration ``k`` starts where iteration ``k - 1`` stopped, so a planner remembers where each planned
iteration started; every rank computes the same values (pure, deterministic, no collective).
"""

from __future__ import annotations

from typing import Sequence

from megatron_slim.plan.pack.costs import SliceCosts
from megatron_slim.plan.pack.training import IterationPacking, Sample, Window, pack_iteration, rank_windows
from megatron_slim.plan.schema import fail


def fill_windows(packing: IterationPacking, windows_per_rank: int, seq_length: int) -> IterationPacking:
    """``packing`` with every DP rank's windows padded to ``windows_per_rank`` by all-padding ones."""
    padding = Window((), seq_length)
    windows = []
    for r, packs in enumerate(packing.plan.ranks):
        real = rank_windows(packing.plan, r, seq_length) if packs else ()
        if len(real) > windows_per_rank:
            raise fail("windows per DP rank", len(real), f"at most {windows_per_rank}")
        windows.append(tuple(real) + (padding,) * (windows_per_rank - len(real)))
    return IterationPacking(packing.method, packing.samples, packing.plan, tuple(windows))


class FixedWindowPlanner:
    """The packed iterations of ``samples`` (the corpus order) for Megatron's fixed microbatch count."""

    def __init__(
        self,
        method: str,
        samples: Sequence[Sample],
        costs: SliceCosts,
        dp: int,
        seq_length: int,
        windows_per_rank: int,
    ) -> None:
        if windows_per_rank < 1 or dp < 1 or not samples:
            raise fail("windows per DP rank", windows_per_rank, "an integer >= 1, with dp >= 1 and a non-empty corpus")
        self.method, self.samples, self.costs = method, tuple(samples), costs
        self.dp, self.seq_length, self.windows_per_rank = dp, seq_length, windows_per_rank
        self._starts = [0]  # where each planned iteration starts in the (wrapping) corpus order
        self._planned: dict[int, IterationPacking] = {}

    def iteration(self, number: int) -> IterationPacking:
        """0-based iteration ``number``'s packing: ``windows_per_rank`` windows on every DP rank."""
        while len(self._starts) <= number:
            k = len(self._starts) - 1
            packing, taken = self._plan(self._starts[k])
            self._planned = {k: packing}  # keep only the latest: a data loader reads iterations in order
            self._starts.append(self._starts[k] + taken)
        if number not in self._planned:
            self._planned = {number: self._plan(self._starts[number])[0]}
        return self._planned[number]

    def _plan(self, start: int) -> tuple[IterationPacking, int]:
        n = len(self.samples)
        budget = self.windows_per_rank * self.dp * self.seq_length
        taken: list[Sample] = []
        total = 0
        while not taken or (len(taken) < n and total + self.samples[(start + len(taken)) % n].length <= budget):
            total += self.samples[(start + len(taken)) % n].length
            taken.append(self.samples[(start + len(taken)) % n])
        while True:
            packing = pack_iteration(self.method, taken, self.costs, self.dp, self.seq_length)
            if max(len(packs) for packs in packing.plan.ranks) <= self.windows_per_rank or len(taken) == 1:
                return fill_windows(packing, self.windows_per_rank, self.seq_length), len(taken)
            taken.pop()
