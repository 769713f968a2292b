#!/usr/bin/env python
"""Group context exchange (``plan/schedule/exchange_groups.py``) on issue 9's must-show config:
13B-class 256K, t1 c8 p8 v5 n16, 8 microbatches, uniform slices (figures in
``benchmarks/results/slimpipe_exchange.md``).

    python benchmarks/slimpipe_exchange_groups.py [--granule N ...]

Prints the simulated bubble of: uniform slices without exchange; the group plan, priced by the
simulator (``simulate_with_group_exchange``, granule 1 is what ``simulate`` and ``train`` plan) for
each granule (default 1 and 2 x cp, the zigzag-CP multiple); the closed form (p - 1) / (n v m + p - 1).
The earlier timed pairing is gone from the product (its 7.98% stays in the results file). With each
plan: blocks, the most senders one taker serves, stage 0's peak activation bytes and the highest
rank's peak memory (takers hold the moved K/V) against the uniform run's.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from slimpipe_exchange_multiway import SETS  # noqa: E402

from megatron_slim.plan.recipe import load_recipe  # noqa: E402
from megatron_slim.plan.schedule.exchange_blocks import ExchangePlan  # noqa: E402
from megatron_slim.plan.schedule.executable import executable  # noqa: E402
from megatron_slim.plan.sim.costs import RecipeCosts  # noqa: E402
from megatron_slim.plan.sim.engine import SimResult, simulate  # noqa: E402
from megatron_slim.plan.sim.exchange_timing import simulate_with_group_exchange  # noqa: E402


def line(label: str, result: SimResult, uniform: SimResult, seconds: float) -> str:
    plan = ExchangePlan.from_text(result.schedule.exchange)
    senders = max((len({b.sender_end for b in blocks}) for blocks in plan.served.values()), default=0)
    act, base = result.ranks[0].peak_activation_bytes, uniform.ranks[0].peak_activation_bytes
    peak = max(r.peak_memory_bytes for r in result.ranks)
    return (
        f"{label:<28} bubble {result.bubble_ratio:6.2%} ({result.pipeline_time_s:.2f} s); "
        f"{len(plan.blocks)} blocks, <= {senders} senders/taker; stage-0 activations "
        f"{act / 2**30:.2f} GiB ({act / base:.3f}x uniform); peak memory {peak / 2**30:.2f} GiB "
        f"({peak / max(r.peak_memory_bytes for r in uniform.ranks):.3f}x); {seconds:.0f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--granule", type=int, nargs="+", help="block bounds in multiples of N tokens")
    args = parser.parse_args()
    recipe = load_recipe("llama2-13b-128k", SETS)
    p = recipe.parallel
    costs = RecipeCosts(recipe)
    schedule = executable(recipe.schedule.kind, p.pp, p.vpp, recipe.num_microbatches, recipe.schedule.num_slices)
    t0 = time.perf_counter()
    uniform = simulate(schedule, costs)
    print(line("uniform, no exchange", uniform, uniform, time.perf_counter() - t0), flush=True)
    for granule in args.granule or [1, 2 * p.cp]:
        t0 = time.perf_counter()
        groups = simulate_with_group_exchange(schedule, costs, costs.lengths, granule)
        print(line(f"groups, granule {granule}", groups, uniform, time.perf_counter() - t0), flush=True)
    slots = recipe.schedule.num_slices * p.vpp * recipe.num_microbatches
    print(f"closed form (p-1)/(n v m + p-1): {(p.pp - 1) / (slots + p.pp - 1):.2%}")


if __name__ == "__main__":
    main()
