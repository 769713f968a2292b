"""Measured kernel rates that replace a hardware profile's efficiency factors.

File format (YAML or JSON), written by ``scripts/calibrate_gpu.py`` on a GPU::

    hardware: h100                 # the profile the numbers were measured on
    source: "scripts/calibrate_gpu.py, 1x H100 SXM, torch 2.11, 2026-11-21"
    measurements:
      - {op: gemm, work: 6.9e10, seconds: 1.1e-4}            # work = FLOPs
      - {op: attention_forward, work: 2.2e12, seconds: 4.9e-3}
      - {op: attention_backward, work: 5.5e12, seconds: 1.6e-2}
      - {op: memory_bound, work: 4.0e9, seconds: 1.6e-3}     # work = bytes read + written

``op`` is one of ``gemm``, ``attention_forward``, ``attention_backward`` (FLOPs as the cost model
counts them: 4·pairs·head_dim·heads forward, 2.5x that backward) or ``memory_bound`` (bytes).
For a kernel of a given size the achieved rate is interpolated linearly in log(work) between the
measurements of its class and held constant beyond the smallest and largest; a class without
measurements keeps the profile's efficiency.
"""

from __future__ import annotations

import bisect
import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

from megatron_slim.plan.files import parse_yaml, read_text
from megatron_slim.plan.hardware import HardwareProfile
from megatron_slim.plan.paths import config_dir
from megatron_slim.plan.schema import ConfigError, build, fail

OpClass = Literal["gemm", "attention_forward", "attention_backward", "memory_bound"]
OP_CLASSES = ("gemm", "attention_forward", "attention_backward", "memory_bound")


@dataclass(frozen=True)
class Measurement:
    op: OpClass
    work: float
    seconds: float
    note: str = ""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.work) and self.work > 0):
            raise fail("work", self.work, "a finite positive number of FLOPs or bytes")
        if not (math.isfinite(self.seconds) and self.seconds > 0):
            raise fail("seconds", self.seconds, "a finite positive number of seconds")
        rate = self.work / self.seconds
        if not (math.isfinite(rate) and rate > 0):
            raise fail(
                "rate",
                f"work {self.work:g} in {self.seconds:g} s",
                "a finite positive rate (work / seconds)",
            )


@dataclass(frozen=True)
class Calibration:
    hardware: str
    measurements: tuple[Measurement, ...]
    source: str = ""

    def __post_init__(self) -> None:
        if not self.measurements:
            raise fail("measurements", [], "at least one measurement")

    @functools.cached_property
    def _points(self) -> dict[str, tuple[list[float], list[tuple[float, float]]]]:
        """Per op class: the sorted works, and (work, rate) in that order (the autotuner asks ``rate``
        millions of times)."""
        out = {}
        for op in OP_CLASSES:
            points = sorted((m.work, m.work / m.seconds) for m in self.measurements if m.op == op)
            out[op] = ([w for w, _ in points], points)
        return out

    def rate(self, op: str, work: float) -> Optional[float]:
        """Achieved work per second for a kernel of ``work``; None if ``op`` was not measured."""
        works, points = self._points.get(op, ([], []))
        if not points:
            return None
        if work <= points[0][0]:
            return points[0][1]
        if work >= points[-1][0]:
            return points[-1][1]
        i = bisect.bisect_left(works, work)
        (w0, r0), (w1, r1) = points[i - 1], points[i]
        t = (math.log(work) - math.log(w0)) / (math.log(w1) - math.log(w0))
        return r0 + t * (r1 - r0)


# A measured rate may not beat the profile's peak (the cost model would price kernels faster than the
# hardware can run them: MFU above 100%), nor be below this share of it (no kernel of a GPU that
# profile describes runs a million times slower; such a number is a unit mistake).
PEAK_TOLERANCE = 1.02  # spec sheets round; a measured rate a few percent above is not a unit error
SLOWEST_SHARE = 1e-6


def check_against_profile(calibration: Calibration, profile: HardwareProfile, flag: str = "--calibration") -> list[str]:
    """Refuse rates the profile cannot have produced; the notes a user should see (a calibration
    measured on another GPU than the recipe's profile is used as measured, and said so)."""
    for m in calibration.measurements:
        peak, unit = (
            (profile.hbm_bandwidth, "bytes/s of HBM bandwidth")
            if m.op == "memory_bound"
            else (profile.peak_bf16_flops, "FLOP/s bf16 peak")
        )
        rate = m.work / m.seconds
        if rate > peak * PEAK_TOLERANCE or rate < peak * SLOWEST_SHARE:
            raise ConfigError(
                f"{flag}: {m.op} measurement of {m.work:g} in {m.seconds:g} s is {rate:.3g}/s, "
                f"{rate / peak:.3g}x the {profile.name} profile's {peak:.3g} {unit}; allowed: rates between "
                f"{SLOWEST_SHARE:g}x and {PEAK_TOLERANCE}x the profile's peak (measured on this hardware, "
                "work in FLOPs or bytes, time in seconds)"
            )
    if calibration.hardware != profile.name:
        return [
            f"note: {flag} was measured on {calibration.hardware!r}; the recipe's hardware profile is "
            f"{profile.name!r}: its rates are used as measured"
        ]
    return []


def shipped_calibrations() -> list[str]:
    """Names of the measured calibrations that ship in ``megatron_slim/configs/calibration/``."""
    return sorted(p.stem for p in (config_dir() / "calibration").glob("*.yaml"))


def load_calibration(path: str | Path, flag: str = "--calibration") -> Calibration:
    """Read and validate a calibration file, or a shipped one by name (``hopper-cudnn``); every
    problem is a ``ConfigError`` naming ``flag`` and the file."""
    path = Path(path)
    if not path.suffix and not path.exists() and path.name == str(path):
        shipped = config_dir() / "calibration" / f"{path}.yaml"
        if not shipped.is_file():
            raise ConfigError(
                f"{flag} {path}: no shipped calibration of that name (allowed: {', '.join(shipped_calibrations())}, "
                "or a path to a YAML or JSON file, format in docs/calibration.md)"
            )
        path = shipped
    where = f"{flag} {path}"
    if not path.exists():
        raise ConfigError(f"{where}: file does not exist (allowed: a YAML or JSON file, format in docs/calibration.md)")
    if not path.is_file():
        what = "a directory" if path.is_dir() else "not a regular file"
        raise ConfigError(f"{where}: is {what} (allowed: a YAML or JSON file)")
    text = read_text(path, where)
    try:
        data = json.loads(text) if path.suffix == ".json" else parse_yaml(text, where)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping with hardware, source, measurements")
    return build(Calibration, data, "calibration")
