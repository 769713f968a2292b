"""What a start-up rule is (``Rule``) and the helpers the rule tables share; the tables live in
``rules_train``, ``rules_cp`` and ``rules_slimpipe``, and ``rules`` checks them in order."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from megatron_slim.plan.startup.settings import Inputs, Settings


@dataclass(frozen=True)
class Rule:
    name: str
    callers: tuple[str, ...]
    broken: Callable[[Settings], bool]
    message: Callable[[Settings, Inputs], str]


def cp_comm_type_set(value: Any) -> bool:
    """Whether Megatron's ``--cp-comm-type`` asks for anything but its default (p2p)."""
    values = value if isinstance(value, (list, tuple)) else [value]
    return any(v not in (None, "p2p") for v in values)


def engine_input(s: Settings, i: Inputs) -> str:
    """The CP engine setting, in the caller's input names."""
    return i.setting("cp_engine", s.cp_engine)
