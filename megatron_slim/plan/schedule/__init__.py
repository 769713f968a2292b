"""Pipeline schedule IR, generators, lowering passes and validator (pure, no torch)."""
from megatron_slim.plan.schedule.generators import GENERATORS, generate, interleaved, one_f_one_b, slimpipe
from megatron_slim.plan.schedule.ir import Action, Kind, Schedule
from megatron_slim.plan.schedule.lower import add_communication, merge_backward, split_backward, strip_communication
from megatron_slim.plan.schedule.validate import ScheduleError, format_grid, validate

__all__ = [
    "Action", "Kind", "Schedule", "GENERATORS", "generate", "one_f_one_b", "interleaved", "slimpipe",
    "add_communication", "strip_communication", "split_backward", "merge_backward",
    "ScheduleError", "format_grid", "validate",
]
