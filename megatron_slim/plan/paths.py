"""Where shipped recipes and hardware profiles are found.

They ship inside the package (``megatron_slim/configs/*.yaml`` and ``megatron_slim/configs/hardware/``,
declared as package data in ``pyproject.toml``), so an installed wheel finds them exactly as a
source checkout does. ``$MEGATRON_SLIM_CONFIGS`` points at another folder of the same layout.
"""

from __future__ import annotations

import os
from pathlib import Path

CONFIGS_ENV = "MEGATRON_SLIM_CONFIGS"


def config_dir() -> Path:
    """``$MEGATRON_SLIM_CONFIGS`` if set, else the package's ``megatron_slim/configs/`` folder."""
    env = os.environ.get(CONFIGS_ENV)
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[1] / "configs"
