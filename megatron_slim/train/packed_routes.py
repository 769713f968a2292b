"""CP-routed outliers in ``megatron-slim train`` (``data.packing: slimpack``, ``cp.engine: zeppelin``).

SlimPack's plan names, for each outlier, its route (``PackingPlan.routes``). Training packs whole
samples, so DP-merge is never available and the planner CP-routes every outlier that fills a window:
it sits alone in one window of the DP replica the plan puts it on. That window runs under Zeppelin's
placement: ``CPRoute.cp_plan`` assembles the very ``choose_placement`` result the planner priced the
sample with (one cached call on the same topology, costs and layers), its SlimPipe slices follow that
plan (``plan/cp/slices.py``: each CP rank holds the plan's rows of a slice; the slice attention and
RoPE read them from ``SliceContext.cp_shares``), as a CP engine's planned windows do
(``train/cp_slices.py``). Every other window runs SlimPipe's query-out CP, split zigzag-wise
(``packed.packed_cp_forward_step``). No remap layer runs (the recipe refuses ``cp.remap``), and the
route is priced without one.

Loss: as for a zigzag window, each CP rank sums its own rows' losses (a rank the plan leaves without
tokens of a slice runs one padding row, out of the loss) and the schedule divides by the whole
slice's loss tokens; the window's ``loss_weight`` times ``cp`` makes the average over CP ranks a sum.
"""

from __future__ import annotations

import functools

from megatron_slim.megatron.cp.window_slices import rows_of_share
from megatron_slim.plan.cp.slices import SliceShare, slice_shares
from megatron_slim.plan.pack.cp_route import CPRoute
from megatron_slim.plan.pack.training import IterationPacking
from megatron_slim.runtime.pipeline.slice_context import SliceContext
from megatron_slim.train.packed import packed_cp_batch_step, packed_loss_func


class RoutedWindows:
    """One rank's routed windows: their plans' slice shares, the forward step and the stage rows."""

    def __init__(self, route: CPRoute, context: SliceContext, cp_group, slice_lengths) -> None:
        self.route, self.context, self.cp_group = route, context, cp_group
        self.slice_lengths = tuple(slice_lengths)
        self.shares: dict[int, tuple[SliceShare, ...]] = {}
        self.placements: dict[int, str] = {}  # microbatch -> the placement it runs (CPPlan.picked)
        self.ran: list[tuple[int, int, str]] = []  # (microbatch, slice, placement or "zigzag"), this iteration

    def prepare(self, packing: IterationPacking, dp_rank: int) -> None:
        """Plan this DP rank's routed windows of the iteration and hand their shares to the slices."""
        self.shares, self.placements, self.ran = {}, {}, []
        for m, sample in packing.cp_routed_windows(dp_rank).items():
            plan = self.route.cp_plan(packing.plan.sample_lengths[sample])
            self.shares[m] = slice_shares(plan, self.slice_lengths)
            self.placements[m] = plan.picked
        self.context.cp_shares = dict(self.shares)

    def stage_rows(self, microbatch: int, slice_: int) -> int:
        """This CP rank's rows of a slice between pipeline stages: the plan's, or the zigzag share."""
        shares = self.shares.get(microbatch)
        if shares is None:
            return self.slice_lengths[slice_] // self.cp_group.size()
        return shares[slice_].rows(self.cp_group.rank())

    def forward_step(self, data_iterator, model):
        batch, info = next(data_iterator), self.context.current
        if info is None:
            raise RuntimeError("a packed window was read outside a SlimPipe slice (allowed: schedule.kind=slimpipe)")
        shares = self.shares.get(info.microbatch)
        if shares is None:
            self.ran.append((info.microbatch, info.slice, "zigzag"))
            return packed_cp_batch_step(self.cp_group, batch, model)
        self.ran.append((info.microbatch, info.slice, self.placements[info.microbatch]))
        local = rows_of_share(batch, shares[info.slice], self.cp_group.rank())
        output = model(local["tokens"], local["position_ids"], None, labels=local["labels"])
        weight, counted = batch["loss_weight"] * self.cp_group.size(), batch["loss_mask"].sum()
        return output, functools.partial(packed_loss_func, local["loss_mask"], weight, counted=counted)
