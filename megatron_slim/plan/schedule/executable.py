"""The schedules the runtime executes, built and checked here so the runtime only runs them.

``executable`` is what every pipeline rank runs for a training step: the generator's schedule,
lowered (``lower.lower``), validated, and checked to carry each link's messages in one order.
``executable_forward_only`` is its evaluation counterpart (``lower.forward_only``), checked the
same way. The simulator times the same lowering of the same generated schedule, so a runtime
plan's ``digest()`` equals the simulated one's.

Both are planned once per shape and process: a training run asks for the same schedule every
iteration, and at 70B / 512K one schedule is about 60K actions (half a second to lower and
validate; ``benchmarks/planning.py``). The shape is (kind, pp, vpp, microbatches, slices): slice
lengths and model sizes do not enter a schedule, only the interpreter's tensors.

``executable_with_exchange`` adds the context-exchange pairing (``exchange.with_exchange`` on the
unit-time timeline, which depends on the schedule and the slice lengths alone, so every rank
derives the same pairs without a cost model) and checks the result the same way. ``megatron-slim
train`` runs the group plan instead (``plan/sim/exchange_timing.py``), the one ``megatron-slim
simulate`` prices; this one serves callers without a recipe's cost model.
"""

from __future__ import annotations

import functools
from collections import OrderedDict

from megatron_slim.plan.schedule.exchange import with_exchange
from megatron_slim.plan.schedule.generators import generate
from megatron_slim.plan.schedule.ir import Schedule
from megatron_slim.plan.schedule.lower import forward_only, lower
from megatron_slim.plan.schedule.validate import check_link_order, validate

# Enough for a run's training and evaluation shapes (the microbatch count of a ramped-up batch
# changes a few times); each entry is one schedule, at most a few tens of MB at 2048K scale.
PLANS_KEPT = 8


@functools.lru_cache(maxsize=PLANS_KEPT)
def executable(kind: str, pp: int, vpp: int, num_microbatches: int, num_slices: int) -> Schedule:
    """With ``pp=1`` (context parallelism alone, or one rank) lowering adds no messages."""
    schedule = lower(generate(kind, pp, vpp, num_microbatches, num_slices))
    return check_link_order(validate(schedule))


@functools.lru_cache(maxsize=PLANS_KEPT)
def executable_with_exchange(kind: str, pp: int, vpp: int, num_microbatches: int, lengths: tuple[int, ...]) -> Schedule:
    """``executable`` carrying its deadlock-free context-exchange pairing for slices of ``lengths``."""
    schedule = executable(kind, pp, vpp, num_microbatches, len(lengths))
    return check_link_order(validate(with_exchange(schedule, lengths)))


def executable_forward_only(schedule: Schedule) -> Schedule:
    """``schedule`` (an ``executable`` one) without its backward: what an evaluation step runs."""
    key = schedule.digest()  # keyed by content: hashing the schedule itself would walk every action
    if key in _FORWARD_ONLY:
        _FORWARD_ONLY.move_to_end(key)
        return _FORWARD_ONLY[key]
    planned = _FORWARD_ONLY[key] = check_link_order(validate(forward_only(schedule)))
    if len(_FORWARD_ONLY) > PLANS_KEPT:
        _FORWARD_ONLY.popitem(last=False)
    return planned


_FORWARD_ONLY: OrderedDict[str, Schedule] = OrderedDict()
