"""Swap a function for its replacement wherever Python code can reach it by name."""

from __future__ import annotations

import sys
from typing import Callable


def replace_everywhere(original: Callable, replacement: Callable) -> None:
    """Rebind every module-level name that refers to ``original`` (imports by name included), so
    modules imported earlier call ``replacement`` and later ``from m import f`` bind it too."""
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not namespace:
            continue
        for name, value in list(namespace.items()):
            if value is original:
                setattr(module, name, replacement)
