"""Pipeline schedule IR, generators, lowering passes and validator (pure, no torch)."""

from megatron_slim.plan.schedule.generators import GENERATORS, generate, interleaved, one_f_one_b, slimpipe
from megatron_slim.plan.schedule.ir import Action, Kind, Schedule
from megatron_slim.plan.schedule.lower import (
    add_communication,
    forward_only,
    lower,
    merge_backward,
    order_receives_by_link,
    split_backward,
    strip_communication,
)
from megatron_slim.plan.schedule.validate import ScheduleError, check_link_order, format_grid, validate

__all__ = [
    "Action",
    "Kind",
    "Schedule",
    "GENERATORS",
    "generate",
    "one_f_one_b",
    "interleaved",
    "slimpipe",
    "add_communication",
    "forward_only",
    "strip_communication",
    "split_backward",
    "merge_backward",
    "order_receives_by_link",
    "lower",
    "ScheduleError",
    "check_link_order",
    "format_grid",
    "validate",
]
