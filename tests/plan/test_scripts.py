"""The measurement scripts run end to end (on CPU at small sizes) and write what their readers
expect: a calibration file the cost model loads, a slice-attention table."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_slim.plan.cost.calibration import OP_CLASSES, load_calibration
from megatron_slim.plan.cost.model import CostModel
from megatron_slim.plan.recipe import load_recipe

pytestmark = pytest.mark.single  # the scripts run torch
ROOT = Path(__file__).resolve().parents[2]


def test_calibrate_script_writes_a_loadable_calibration(tmp_path):
    out = tmp_path / "cpu.yaml"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "calibrate_gpu.py"),
            "--device",
            "cpu",
            "--hardware",
            "cpu",
            "--sizes",
            "small",
            "--out",
            str(out),
        ],
        check=True,
        capture_output=True,
    )
    cal = load_calibration(out)
    assert cal.hardware == "cpu" and {m.op for m in cal.measurements} == set(OP_CLASSES)
    assert all(m.seconds > 0 for m in cal.measurements)
    recipe = load_recipe("tiny-cpu")
    assert CostModel(recipe, calibration=cal).forward_time(1, 128, 0) > 0


def test_slice_attention_benchmark_reports_both_paths(tmp_path):
    out = tmp_path / "bench.json"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "bench_slice_attention.py"),
            "--device",
            "cpu",
            "--lengths",
            "256",
            "--slices",
            "4",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--head-dim",
            "16",
            "--repeats",
            "1",
            "--out-json",
            str(out),
        ],
        check=True,
        capture_output=True,
    )
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 1 and rows[0]["full_tflops"] > 0 and rows[0]["sliced_tflops"] > 0
