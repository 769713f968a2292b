import json

import pytest

from megatron_slim.cli import main
from megatron_slim.plan.schedule import Action

RANK_KEYS = {"rank", "stage", "peak_memory_bytes", "peak_activation_bytes", "peak_kv_bytes", "static_bytes", "busy_s"}


def test_simulate_writes_json_trace_and_plot(tmp_path, capsys):
    js, trace, png = tmp_path / "r.json", tmp_path / "t.json", tmp_path / "p.png"
    assert main(["simulate", "--recipe", "tiny-cpu", "--set", "train.global_batch_size=4",
                 "--json", str(js), "--trace", str(trace), "--plot", str(png)]) == 0
    out = json.loads(js.read_text())
    assert {"schedule", "num_microbatches", "iteration_time_s", "bubble_ratio", "mfu", "ranks"} <= set(out)
    assert out["schedule"] == "slimpipe" and out["num_microbatches"] == 4
    assert len(out["ranks"]) == 4 and all(RANK_KEYS <= set(r) for r in out["ranks"])
    assert 0 <= out["bubble_ratio"] < 1 and out["iteration_time_s"] > 0
    events = json.loads(trace.read_text())["traceEvents"]
    names = [e["name"] for e in events if e["ph"] == "X"]
    assert names and all(str(Action.parse(n)) == n for n in names)
    assert any(e["ph"] == "C" for e in events)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "slimpipe" in capsys.readouterr().out


def test_compare_prints_a_table_and_json_to_stdout(capsys):
    assert main(["simulate", "--recipe", "llama2-70b-512k", "--compare", "1f1b,interleaved,slimpipe",
                 "--json", "-"]) == 0
    captured = capsys.readouterr()
    payload = json.loads(captured.out)
    kinds = [r["schedule"] for r in payload["results"]]
    assert kinds == ["1f1b", "interleaved", "slimpipe"]
    by = {r["schedule"]: r for r in payload["results"]}
    assert by["slimpipe"]["bubble_ratio"] < by["interleaved"]["bubble_ratio"] < by["1f1b"]["bubble_ratio"]
    assert by["slimpipe"]["fits_in_memory"] and not by["1f1b"]["fits_in_memory"]
    assert "schedule" in captured.err and "NO (OOM)" in captured.err


@pytest.mark.parametrize("argv,needle", [
    (["simulate", "--recipe", "tiny-cpu", "--compare", "1f1b,zb"], "--compare: unknown schedule 'zb'"),
    (["simulate", "--recipe", "tiny-cpu", "--set", "parallel.pp=3"], "parallel.pp: invalid value (got 3"),
    (["simulate", "--recipe", "tiny-cpu", "--calibration", "/nonexistent.yaml"], "does not exist"),
])
def test_user_errors_exit_2_with_a_named_message(argv, needle, capsys):
    assert main(argv) == 2
    assert needle in capsys.readouterr().err
