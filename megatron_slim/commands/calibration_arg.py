"""``--calibration FILE`` for a recipe: loaded, checked against the recipe's hardware profile (no
rate above its peak or absurdly below it), and a note on stderr when it was measured on another GPU."""

from __future__ import annotations

import sys
from typing import Optional

from megatron_slim.plan.cost.calibration import Calibration, check_against_profile, load_calibration
from megatron_slim.plan.recipe import Recipe


def calibration_for(path: Optional[str], recipe: Recipe) -> Optional[Calibration]:
    if not path:
        return None
    calibration = load_calibration(path)
    for note in check_against_profile(calibration, recipe.hardware_profile, f"--calibration {path}"):
        print(note, file=sys.stderr, flush=True)
    return calibration
