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


def test_layer_memory_script_measures_near_the_cost_model(tmp_path):
    out = tmp_path / "layer_memory.json"
    args = ["--device", "cpu", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--ffn", "160", "--tokens", "32,96"]
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "measure_gpu_memory.py"), *args, "--out", str(out)],
        check=True,
        capture_output=True,
    )
    result = json.loads(out.read_text())
    assert result["dtype"] == "torch.float32" and result["shape"]["kv_heads"] == 2
    assert [r["tokens"] for r in result["rows"]] == [32, 96]
    for row in result["rows"]:
        n = row["tokens"]
        assert row["forward_delta_bytes"] is None and row["backward_peak_above_start_bytes"] is None  # CUDA only
        assert row["saved_storage_bytes"] == sum(s["bytes"] for s in row["saved_storages"])
        assert row["model_kv_bytes"] == 2 * n * 2 * 16 * 4  # K and V: 2 kv heads of 16, fp32
        measured, predicted = row["saved_storage_bytes"], row["model_local_bytes"] + row["model_kv_bytes"]
        assert 0.8 < measured / predicted < 1.25, (measured, predicted)
    per_token = [r["saved_storage_bytes"] / r["tokens"] for r in result["rows"]]
    assert per_token[0] == per_token[1]  # linear in tokens: no s^2 tensor saved


def test_offload_bandwidth_script_writes_every_mode_and_load(tmp_path):
    out = tmp_path / "offload.json"
    args = ["--device", "cpu", "--sizes-mib", "1,2", "--gemm-size", "32", "--repeats", "1", "--hardware", "h100"]
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "measure_offload_bandwidth.py"), *args, "--out", str(out)],
        check=True,
        capture_output=True,
    )
    result = json.loads(out.read_text())
    assert result["profile_pcie_bandwidth_gbps"] == 64.0 and result["pinned"] is False
    points = {(r["size_mib"], r["mode"], r["load"]) for r in result["rows"]}
    assert points == {(s, m, lo) for s in (1.0, 2.0) for m in ("h2d", "d2h", "both") for lo in ("alone", "gemm")}
    for row in result["rows"]:
        directions = ("h2d", "d2h") if row["mode"] == "both" else (row["mode"],)
        assert all(row[f"{d}_gbps"] > 0 for d in directions) and row["aggregate_gbps"] > 0
        under_gemm = row["load"] == "gemm"
        assert (row["gemm_slowdown"] is not None) == under_gemm and (row["gemms"] > 0) == under_gemm


def test_served_overlap_script_times_both_passes_and_key_ranges(tmp_path):
    out = tmp_path / "overlap.json"
    args = ["--device", "cpu", "--tokens", "32", "--repeats", "1", "--hidden-size", "256"]
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "measure_served_overlap.py"), *args, "--out", str(out)],
        check=True,
        capture_output=True,
    )
    written = json.loads(out.read_text())
    rows = written["rows"]
    assert written["hidden_size"] == 256
    assert {(r["block_keys"], r["block_pass"]) for r in rows} == {
        (k, p) for k in (8, 64) for p in ("forward", "backward")
    }
    for row in rows:
        assert min(row["own_s"], row["block_s"], row["overlapped_s"]) > 0
        assert row["overlapped_over_sum"] == row["overlapped_s"] / (row["own_s"] + row["block_s"])
