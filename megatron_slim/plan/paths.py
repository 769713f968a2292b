"""Where shipped recipes and hardware profiles are found."""
from __future__ import annotations

import os
from pathlib import Path


def config_dir() -> Path:
    """``$MEGATRON_SLIM_CONFIGS`` if set, else the repository's ``configs/`` folder."""
    env = os.environ.get("MEGATRON_SLIM_CONFIGS")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "configs"
