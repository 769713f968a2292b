import json

import pytest

from megatron_slim.cli import main
from megatron_slim.plan.schedule import Action

RANK_KEYS = {
    "rank",
    "stage",
    "peak_memory_bytes",
    "peak_activation_bytes",
    "peak_kv_bytes",
    "peak_p2p_bytes",
    "static_bytes",
    "busy_s",
}


def test_simulate_writes_json_trace_and_plot(tmp_path, capsys):
    js, trace, png = tmp_path / "r.json", tmp_path / "t.json", tmp_path / "p.png"
    assert (
        main(
            [
                "simulate",
                "--recipe",
                "tiny-cpu",
                "--set",
                "train.global_batch_size=4",
                "--json",
                str(js),
                "--trace",
                str(trace),
                "--plot",
                str(png),
            ]
        )
        == 0
    )
    out = json.loads(js.read_text())
    assert {"schedule", "num_microbatches", "iteration_time_s", "bubble_ratio", "mfu", "ranks"} <= set(out)
    assert out["schedule"] == "slimpipe" and out["num_microbatches"] == 4
    assert len(out["ranks"]) == 4 and all(set(r) >= RANK_KEYS for r in out["ranks"])
    assert 0 <= out["bubble_ratio"] < 1 and out["iteration_time_s"] > 0
    events = json.loads(trace.read_text())["traceEvents"]
    names = [e["name"] for e in events if e["ph"] == "X"]
    assert names and all(str(Action.parse(n)) == n for n in names)
    assert any(e["ph"] == "C" for e in events)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "slimpipe" in capsys.readouterr().out


def test_compare_prints_a_table_and_json_to_stdout(capsys):
    # 70B at 512K, cut to 4 microbatches and 2 chunks per rank: still only SlimPipe fits in memory
    small = ["--set", "train.global_batch_size=4", "--set", "parallel.vpp=2"]
    argv = ["simulate", "--recipe", "llama2-70b-512k", *small, "--compare", "1f1b,interleaved,slimpipe", "--json", "-"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    payload = json.loads(captured.out)
    kinds = [r["schedule"] for r in payload["results"]]
    assert kinds == ["1f1b", "interleaved", "slimpipe"]
    by = {r["schedule"]: r for r in payload["results"]}
    assert by["slimpipe"]["bubble_ratio"] < by["interleaved"]["bubble_ratio"] < by["1f1b"]["bubble_ratio"]
    assert by["slimpipe"]["fits_in_memory"] and not by["1f1b"]["fits_in_memory"]
    assert "schedule" in captured.err and "NO (OOM)" in captured.err


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["simulate", "--recipe", "tiny-cpu", "--compare", "1f1b,zb"], "--compare: unknown schedule 'zb'"),
        (["simulate", "--recipe", "tiny-cpu", "--set", "parallel.pp=3"], "parallel.pp: invalid value (got 3"),
        (["simulate", "--recipe", "tiny-cpu", "--calibration", "/nonexistent.yaml"], "does not exist"),
    ],
)
def test_user_errors_exit_2_with_a_named_message(argv, needle, capsys):
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


def test_missing_output_directories_are_created(tmp_path, monkeypatch, capsys):
    """The README's `--json out/sim.json --trace out/sim.trace.json --plot out/sim.png` on a fresh clone."""
    monkeypatch.chdir(tmp_path)
    assert (
        main(
            [
                "simulate",
                "--recipe",
                "tiny-cpu",
                "--set",
                "train.global_batch_size=4",
                "--json",
                "out/sim.json",
                "--trace",
                "out/deeper/sim.trace.json",
                "--plot",
                "out/sim.png",
            ]
        )
        == 0
    )
    assert json.loads((tmp_path / "out/sim.json").read_text())["schedule"] == "slimpipe"
    assert json.loads((tmp_path / "out/deeper/sim.trace.json").read_text())["traceEvents"]
    assert (tmp_path / "out/sim.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("flag", ["--json", "--trace", "--plot"])
def test_an_unwritable_output_fails_before_any_work(flag, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    bad = str(blocker / "x.out")  # its parent is a file: no directory can be made there
    assert main(["simulate", "--recipe", "tiny-cpu", flag, bad]) == 2
    captured = capsys.readouterr()
    assert f"{flag} {bad}: cannot write" in captured.err
    assert "schedule" not in captured.out  # nothing was simulated
    assert main(["simulate", "--recipe", "tiny-cpu", flag, str(tmp_path)]) == 2
    assert f"{flag} {tmp_path}: cannot write" in capsys.readouterr().err


def test_a_path_naming_a_missing_directory_fails_before_any_work(tmp_path, capsys):
    missing = f"{tmp_path}/not-yet/"
    assert main(["simulate", "--recipe", "tiny-cpu", "--plot", missing]) == 2
    captured = capsys.readouterr()
    assert f"--plot {missing}: cannot write (it is a directory)" in captured.err and "schedule" not in captured.out
    assert not (tmp_path / "not-yet").exists()


def test_the_plot_is_written_to_exactly_the_path_named_and_only_as_png(tmp_path, capsys):
    bare = tmp_path / "timeline"
    assert main(["simulate", "--recipe", "tiny-cpu", "--set", "train.global_batch_size=4", "--plot", str(bare)]) == 0
    assert f"wrote plot {bare}\n" in capsys.readouterr().out and bare.read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["timeline"]
    svg = tmp_path / "timeline.svg"
    assert main(["simulate", "--recipe", "tiny-cpu", "--plot", str(svg)]) == 2
    assert f"--plot {svg}: a PNG image; allowed: a path ending in .png" in capsys.readouterr().err


def test_two_outputs_on_one_path_are_refused(tmp_path, capsys):
    path = str(tmp_path / "same.json")
    assert main(["simulate", "--recipe", "tiny-cpu", "--json", path, "--trace", path]) == 2
    assert f"--trace {path}: cannot write" in capsys.readouterr().err


@pytest.mark.parametrize(
    "recipe,extra",
    [
        ("llama2-7b-64k", []),
        ("llama2-7b-64k", ["--compare", "1f1b,slimpipe"]),
        ("tiny-cpu", ["schedule.kind=1f1b", "schedule.num_slices=1"]),
    ],
)
def test_one_pipeline_stage_simulates(recipe, extra, capsys):
    sets = [x for x in extra if "=" in x]
    rest = [x for x in extra if "=" not in x]
    assert main(["simulate", "--recipe", recipe, "--set", "parallel.pp=1", *sets, *rest, "--json", "-"]) == 0
    payload = json.loads(capsys.readouterr().out)
    for result in payload.get("results", [payload]):
        assert len(result["ranks"]) == 1 and result["bubble_ratio"] == pytest.approx(0.0, abs=1e-9)
        assert result["iteration_time_s"] > 0


def test_an_override_that_changes_the_gpu_count_says_so(capsys):
    few = "train.global_batch_size=32"  # 8 microbatches: the note does not depend on their number
    assert main(["simulate", "--recipe", "llama2-7b-64k", "--set", "parallel.pp=8", "schedule.num_slices=16", few]) == 0
    out = capsys.readouterr().out
    assert "note: --set parallel.pp=8 changes the job from 64 to 128 GPUs (tp4 pp8 cp1 dp4)" in out
    assert main(["simulate", "--recipe", "llama2-7b-64k", "--set", "schedule.num_slices=16", few]) == 0
    assert "note:" not in capsys.readouterr().out


@pytest.mark.parametrize(
    "content,needle",
    [
        (None, "does not exist"),
        ("dir", "is a directory"),
        ("measurements: [unclosed", "not valid YAML"),
        ("- just\n- a list\n", "expected a mapping"),
    ],
)
def test_a_bad_calibration_file_fails_before_any_work(content, needle, tmp_path, capsys):
    path = tmp_path / "cal.yaml"
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_text(content)
    assert main(["simulate", "--recipe", "tiny-cpu", "--calibration", str(path)]) == 2
    captured = capsys.readouterr()
    assert f"--calibration {path}" in captured.err and needle in captured.err
    assert "schedule" not in captured.out


@pytest.mark.parametrize(
    "measurement,needle",
    [
        ("{op: gemm, work: 1.0e12, seconds: 3.0e-4}", "gemm measurement of 1e+12 in 0.0003 s is 3.33e+15/s, 3.37x"),
        ("{op: memory_bound, work: 1.0e3, seconds: 1.0e3}", "memory_bound measurement of 1000 in 1000 s is 1/s"),
        ("{op: gemm, work: 1.0e-300, seconds: 1.0e300}", "rate: invalid value (got 'work 1e-300 in 1e+300 s'"),
    ],
    ids=["above-peak", "absurdly-slow", "underflows"],
)
def test_a_calibration_the_recipes_hardware_cannot_have_measured_is_refused(measurement, needle, tmp_path, capsys):
    """A rate above the profile's peak would price kernels faster than the GPU runs them (MFU 330%);
    a rate a million times below it is a unit mistake (and 0 divided the kernel times by zero)."""
    path = tmp_path / "cal.yaml"
    path.write_text(f"hardware: h800\nmeasurements:\n  - {measurement}\n")
    assert main(["simulate", "--recipe", "zeppelin-7b-h800", "--calibration", str(path)]) == 2
    captured = capsys.readouterr()
    assert needle in captured.err and "schedule" not in captured.out


def test_a_calibration_measured_on_another_gpu_is_used_and_said_so(tmp_path, capsys):
    path = tmp_path / "cal.yaml"
    path.write_text("hardware: h100\nmeasurements:\n  - {op: gemm, work: 1.0e12, seconds: 2.0e-3}\n")
    assert main(["simulate", "--recipe", "zeppelin-7b-h800", "--calibration", str(path)]) == 0
    err = capsys.readouterr().err
    assert f"note: --calibration {path} was measured on 'h100'; the recipe's hardware profile is 'h800'" in err


def test_seed_without_lengths_is_refused_not_ignored(capsys):
    """--seed draws --lengths; a pipeline simulation has nothing to draw, so the flag would be dropped."""
    assert main(["simulate", "--recipe", "tiny-cpu", "--seed", "5"]) == 2
    captured = capsys.readouterr()
    assert "--seed 5" in captured.err and "--lengths" in captured.err and not captured.out
