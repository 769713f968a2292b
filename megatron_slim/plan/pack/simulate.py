"""Time a packing plan with the pipeline simulator: every DP rank's MicroPacks through the recipe's
schedule (``pipeline_costs.PackedCosts``), the iteration waiting for the slowest rank.

Iteration time: the slowest DP rank's simulated pipeline plus gradient sync and optimizer step
(``SimResult.iteration_time_s``). MFU: the model FLOPs of every document whole (causal, no
recompute) over ``iteration * GPUs * peak``. Peak memory: the highest simulated peak of any
pipeline rank of any DP rank. Padding share and the forward / backward imbalance (max/mean over
DP ranks of the plan's priced work) are ``evaluate.py``'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from megatron_slim.plan.cost.model import CostModel
from megatron_slim.plan.pack.assemble import spread_samples
from megatron_slim.plan.pack.evaluate import evaluate
from megatron_slim.plan.pack.pipeline_costs import PackedCosts, routed_scales
from megatron_slim.plan.pack.plan import PackingPlan
from megatron_slim.plan.progress import Progress
from megatron_slim.plan.schedule.generators import generate
from megatron_slim.plan.schema import ConfigError
from megatron_slim.plan.sim.engine import SimResult, simulate


@dataclass(frozen=True)
class PackedSimulation:
    method: str
    iteration_time_s: float
    tokens_per_s: float
    mfu: float
    padding_share: float
    fwd_imbalance: float
    bwd_imbalance: float
    peak_memory_bytes: float
    micropacks: int
    slowest_rank: int
    hbm_bytes: float
    outlier_routes: tuple[tuple[str, int], ...] = ()  # outliers per route, when the plan chose routes

    def to_json(self) -> dict[str, float | int | dict[str, int]]:
        out: dict[str, float | int | dict[str, int]] = {
            "iteration_time_s": self.iteration_time_s,
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "padding_share": self.padding_share,
            "fwd_imbalance": self.fwd_imbalance,
            "bwd_imbalance": self.bwd_imbalance,
            "peak_memory_bytes": int(self.peak_memory_bytes),
            "micropacks": self.micropacks,
            "slowest_dp_rank": self.slowest_rank,
        }
        if self.outlier_routes:
            out["outlier_routes"] = dict(self.outlier_routes)
        return out


def schedule_slices(cost: CostModel) -> int:
    s = cost.recipe.schedule
    return s.num_slices if s.kind == "slimpipe" else 1


def simulate_rank(
    plan: PackingPlan,
    rank: int,
    cost: CostModel,
    flops: float,
    progress: Optional[Progress] = None,
    scales: Optional[dict[int, tuple[float, float]]] = None,
) -> Optional[SimResult]:
    """DP rank ``rank``'s pipeline (None when it holds no MicroPack); ``scales``: ``routed_scales``
    of the plan, when the caller has them."""
    packs = plan.ranks[rank]
    if not packs:
        return None
    r, p, n = cost.recipe, cost.recipe.parallel, schedule_slices(cost)
    spread = frozenset(spread_samples([[list(m.pieces) for m in ms] for ms in plan.ranks]))
    scales = routed_scales(plan, cost) if scales is None else scales
    costs = PackedCosts(cost, packs, n, spread, flops, scales=scales)
    try:
        schedule = generate(r.schedule.kind, p.pp, p.vpp, len(packs), n)
    except ValueError as exc:
        raise ConfigError(f"packing {plan.method}: DP rank {rank} has {len(packs)} MicroPacks: {exc}") from None
    return simulate(schedule, costs, progress)


def simulate_plan(plan: PackingPlan, cost: CostModel, progress: Optional[Progress] = None) -> PackedSimulation:
    if plan.dp != cost.recipe.parallel.dp:
        raise ConfigError(f"packing {plan.method}: plan has dp={plan.dp}, recipe parallel.dp={cost.recipe.parallel.dp}")
    total_flops = math.fsum(cost.model_flops(n) for n in plan.sample_lengths)
    tokens = sum(plan.sample_lengths)
    pp = cost.recipe.parallel.pp
    after = max(cost.grad_sync_time(s) + cost.optimizer_time(s) for s in range(pp))
    times, peaks = [], []
    scales = routed_scales(plan, cost)
    for rank, packs in enumerate(plan.ranks):
        share = total_flops * sum(m.tokens for m in packs) / tokens
        res = simulate_rank(plan, rank, cost, share, progress, scales)
        times.append(res.iteration_time_s if res else after)
        peaks.append(max(x.peak_memory_bytes for x in res.ranks) if res else max(map(cost.static_bytes, range(pp))))
    slowest = max(range(plan.dp), key=lambda i: times[i])
    iteration = times[slowest]
    simple = evaluate(plan, pp)
    gpus = cost.recipe.parallel.world_size
    per_gpu_flops = total_flops * cost.recipe.parallel.tp * cost.recipe.parallel.cp
    return PackedSimulation(
        method=plan.method,
        iteration_time_s=iteration,
        tokens_per_s=tokens / iteration if iteration > 0 else math.inf,
        mfu=per_gpu_flops / (iteration * gpus * cost.hw.peak_bf16_flops) if iteration > 0 else 0.0,
        padding_share=simple.padding_share,
        fwd_imbalance=simple.fwd_imbalance,
        bwd_imbalance=simple.bwd_imbalance,
        peak_memory_bytes=max(peaks),
        micropacks=simple.micropacks,
        slowest_rank=slowest,
        hbm_bytes=cost.hw.usable_hbm_bytes,
        outlier_routes=tuple(plan.route_counts().items()) if plan.routes else (),
    )
