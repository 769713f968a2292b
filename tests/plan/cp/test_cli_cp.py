import json

import pytest

from megatron_slim.cli import main
from megatron_slim.plan.cp.engines import ENGINES

SMALL = ["--set", "train.global_batch_size=1"]
CP_SIMULATE = ["simulate", "--recipe", "zeppelin-7b-h800"]
TWO_NODES = ["--set", "parallel.cp=16", "--set", "model.seq_length=65536"]  # of the recipe's four
SPEC = "lognormal:mean=4096,sigma=1.2,min=256,max=65536"


@pytest.mark.parametrize("engine", ENGINES)
def test_each_engine_writes_json(engine, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert (
        main(
            [
                *CP_SIMULATE,
                "--cp-engine",
                engine,
                "--lengths",
                SPEC,
                "--seed",
                "3",
                "--json",
                str(out),
                *SMALL,
            ]
        )
        == 0
    )
    data = json.loads(out.read_text())
    assert data["engine"] == engine and data["seed"] == 3 and data["lengths"] == SPEC
    assert data["num_packs"] == 1 and data["tokens"] == 262144 and sum(data["pack_lengths"][0]) == 262144
    assert data["iteration_time_s"] > 0 and data["tokens_per_s"] > 0 and 0 < data["mfu"] < 1
    assert len(data["ranks"]) == 32 and {"attention_s", "linear_s", "idle_s", "comm_s"} <= set(data["ranks"][0])
    pack = data["packs"][0]
    assert len(pack["digest"]) == 64 and pack["time_s"] == pytest.approx(
        32 * (pack["forward_layer_s"] + pack["backward_layer_s"])
    )
    assert data["remap"] is (engine == "zeppelin")
    assert engine in capsys.readouterr().out


def test_all_engines_side_by_side_to_stdout(capsys):
    assert (
        main(
            ["simulate", "--recipe", "zeppelin-7b-h800", "--cp-engine", "all", "--lengths", SPEC, "--json", "-", *SMALL]
        )
        == 0
    )
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert [r["engine"] for r in data["results"]] == list(ENGINES)
    assert "vs ring" in captured.err and "zeppelin +remap" in captured.err
    by = {r["engine"]: r for r in data["results"]}
    assert by["zeppelin"]["iteration_time_s"] < by["ring"]["iteration_time_s"]


def test_recipe_engine_is_the_default_and_a_file_works(tmp_path, capsys):
    lengths = tmp_path / "l.txt"
    lengths.write_text("\n".join(["4096"] * 8) + "\n")
    assert (
        main(
            [
                *CP_SIMULATE,
                "--lengths",
                str(lengths),
                *SMALL,
                "--set",
                "cp.engine=dynamic",
                "--json",
                "-",
            ]
        )
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert data["engine"] == "dynamic" and set(data["pack_lengths"][0]) == {4096}


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--cp-engine", "ring,foo", "--lengths", SPEC], "--cp-engine: invalid value (got 'foo'"),
        (["--cp-engine", "ring"], "--lengths: required"),
        (["--cp-engine", "ring", "--lengths", "lognormal:mean=1"], "lognormal.sigma: missing key"),
        (
            [
                "--cp-engine",
                "ulysses",
                "--lengths",
                SPEC,
                "--set",
                "model.num_attention_heads=16",
                "model.num_query_groups=16",
            ],
            "num_attention_heads=16",
        ),
        (["--cp-engine", "ring", "--lengths", SPEC, "--set", "parallel.pp=2"], "parallel.pp: invalid value"),
        (
            ["--cp-engine", "ring", "--lengths", SPEC, "--set", "parallel.dp=2", "train.global_batch_size=2"],
            "parallel.dp: invalid value",
        ),
        (["--cp-engine", "ring", "--lengths", SPEC, "--compare", "1f1b"], "--compare"),
    ],
)
def test_user_errors_exit_2_naming_the_input(argv, needle, capsys):
    assert main(["simulate", "--recipe", "zeppelin-7b-h800", *argv]) == 2
    assert needle in capsys.readouterr().err


def test_a_missing_calibration_fails_before_any_work(tmp_path, capsys):
    missing = tmp_path / "nope.yaml"
    assert (
        main(
            [
                *CP_SIMULATE,
                "--cp-engine",
                "ring",
                "--lengths",
                SPEC,
                "--calibration",
                str(missing),
                *SMALL,
            ]
        )
        == 2
    )
    captured = capsys.readouterr()
    assert f"--calibration {missing}: file does not exist" in captured.err and "engine" not in captured.out


def test_a_calibration_file_prices_the_cp_kernels(tmp_path, capsys):
    """Measured rates replace the profile's efficiencies on the CP path as on the pipeline path."""
    slow = tmp_path / "slow.yaml"
    slow.write_text(
        "hardware: h800\nmeasurements:\n"
        "  - {op: attention_forward, work: 1.0e12, seconds: 1.0}\n"
        "  - {op: attention_backward, work: 1.0e12, seconds: 1.0}\n"
    )
    argv = ["simulate", "--recipe", "zeppelin-7b-h800", "--cp-engine", "ring", "--lengths", SPEC, *SMALL, "--json", "-"]
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(argv + ["--calibration", str(slow)]) == 0
    calibrated = json.loads(capsys.readouterr().out)
    assert calibrated["iteration_time_s"] > 10 * plain["iteration_time_s"]
    assert calibrated["calibration"] == str(slow) and plain["calibration"] is None


def test_trace_and_plot_show_each_engine_per_rank(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert (
        main(
            [
                *CP_SIMULATE,
                "--cp-engine",
                "ring,zeppelin",
                "--lengths",
                SPEC,
                "--set",
                "train.global_batch_size=2",
                *TWO_NODES,
                "--trace",
                "out/cp.trace.json",
                "--plot",
                "out/cp.png",
                "--json",
                "out/cp.json",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "wrote trace out/cp.trace.json" in printed and "wrote plot out/cp.png" in printed
    assert (tmp_path / "out/cp.png").read_bytes()[:4] == b"\x89PNG"
    trace = json.loads((tmp_path / "out/cp.trace.json").read_text())
    events = trace["traceEvents"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert {f"{engine} rank {r}" for engine in ("ring", "zeppelin") for r in range(16)} <= names
    spans = [e for e in events if e["ph"] == "X"]
    by_engine = {e["pid"] // 1000 for e in spans}
    assert by_engine == {0, 1}
    categories = {e["cat"] for e in spans}
    assert {"attention", "linear", "comm"} <= categories
    assert any(e["name"].startswith("pack 1 backward") for e in spans)
    # each compute stream runs one task at a time
    per_thread: dict = {}
    for e in spans:
        per_thread.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for intervals in per_thread.values():
        intervals.sort()
        assert all(b[0] >= a[1] - 2e-3 for a, b in zip(intervals, intervals[1:]))  # times rounded to 1 ns
    # one layer per pack, forward then backward, back to back
    data = json.loads((tmp_path / "out/cp.json").read_text())
    ring = data["results"][0]
    one_layer = sum(p["forward_layer_s"] + p["backward_layer_s"] for p in ring["packs"])
    ring_end = max(e["ts"] + e["dur"] for e in spans if e["pid"] < 1000)
    assert ring_end == pytest.approx(one_layer * 1e6, rel=1e-6)


def test_one_engine_writes_both_trace_and_plot(tmp_path, capsys):
    assert (
        main(
            [
                *CP_SIMULATE,
                "--cp-engine",
                "dynamic",
                "--lengths",
                SPEC,
                *SMALL,
                "--trace",
                str(tmp_path / "t.json"),
                "--plot",
                str(tmp_path / "p.png"),
                "--json",
                "-",
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    assert json.loads(captured.out)["engine"] == "dynamic" and "wrote plot" in captured.err
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert {f"dynamic rank {r}" for r in range(32)} <= names and all(n.startswith("dynamic") for n in names)
    assert {"attention", "linear"} <= {e["cat"] for e in events if e["ph"] == "X"}


def test_seed_defaults_to_zero_with_lengths(capsys):
    assert (
        main(
            [
                *CP_SIMULATE,
                "--cp-engine",
                "ring",
                "--lengths",
                SPEC,
                *SMALL,
                "--json",
                "-",
            ]
        )
        == 0
    )
    default = json.loads(capsys.readouterr().out)
    assert (
        main(
            [
                *CP_SIMULATE,
                "--cp-engine",
                "ring",
                "--lengths",
                SPEC,
                *SMALL,
                "--seed",
                "0",
                "--json",
                "-",
            ]
        )
        == 0
    )
    assert default["seed"] == 0 and json.loads(capsys.readouterr().out)["pack_lengths"] == default["pack_lengths"]
