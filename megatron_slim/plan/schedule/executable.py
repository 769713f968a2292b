"""The schedules the runtime executes, built and checked here so the runtime only runs them.

``executable`` is what every pipeline rank runs for a training step: the generator's schedule,
lowered (``lower.lower``), validated, and checked to carry each link's messages in one order.
``executable_forward_only`` is its evaluation counterpart (``lower.forward_only``), checked the
same way. The simulator times the same lowering of the same generated schedule, so a runtime
plan's ``digest()`` equals the simulated one's.
"""

from __future__ import annotations

from megatron_slim.plan.schedule.generators import generate
from megatron_slim.plan.schedule.ir import Schedule
from megatron_slim.plan.schedule.lower import forward_only, lower
from megatron_slim.plan.schedule.validate import check_link_order, validate


def executable(kind: str, pp: int, vpp: int, num_microbatches: int, num_slices: int) -> Schedule:
    """With ``pp=1`` (context parallelism alone, or one rank) lowering adds no messages."""
    schedule = lower(generate(kind, pp, vpp, num_microbatches, num_slices))
    return check_link_order(validate(schedule))


def executable_forward_only(schedule: Schedule) -> Schedule:
    """``schedule`` (an ``executable`` one) without its backward: what an evaluation step runs."""
    return check_link_order(validate(forward_only(schedule)))
