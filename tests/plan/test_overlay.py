"""``megatron-slim overlay`` on traces shaped as ``train --profile`` writes them (torch profiler
Chrome JSON, one file per rank, a ``megatron_slim`` entry), here made from a simulation: a
"measured" run that is the simulation itself must compare equal to it, whatever each rank's clock
base; bad traces and a recipe other than the traced one are refused before any work."""

import json

import pytest

from megatron_slim.cli import main
from megatron_slim.commands.simulate import run_one
from megatron_slim.plan.recipe import load_recipe

SETS = ["parallel.dp=2", "train.global_batch_size=8"]  # pp4 x dp2: 8 ranks, 4 microbatches per replica


def _fake_traces(directory, sets=SETS, run_id="abc123", digest=None):
    """One trace per rank; pipeline rank r at dp rank 0 holds the simulated events of rank r on a
    clock whose base differs per rank, dp rank 1 holds nonsense timings (must be ignored)."""
    recipe = load_recipe("tiny-cpu", sets)
    result = run_one(recipe).result
    directory.mkdir(parents=True, exist_ok=True)
    pp = recipe.parallel.pp
    for rank in range(recipe.parallel.world_size):
        pp_rank, dp_rank = rank % pp, rank // pp
        base_ns = 1_790_000_000_000_000_000 + 7_000_000_000 * rank  # each rank its own clock base
        shift_us = 3_000_000.0 - 7_000_000.0 * rank + 1234.5  # ... and ts relative to it: same wall clock
        events = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": shift_us, "dur": 5.0}]
        for e in result.events:
            if e.rank == pp_rank:
                scale = 1.0 if dp_rank == 0 else 9.0
                events.append(
                    {
                        "ph": "X",
                        "cat": "user_annotation",
                        "name": e.name,
                        "ts": shift_us + e.start * 1e6 * scale,
                        "dur": (e.end - e.start) * 1e6 * scale,
                    }
                )
        meta = {
            "rank": rank,
            "world_size": recipe.parallel.world_size,
            "pp_rank": pp_rank,
            "tp_rank": 0,
            "cp_rank": 0,
            "dp_rank": dp_rank,
            "recipe": recipe.to_dict(),
            "run_id": run_id,
            "iteration": 3,
            "schedule_digest": digest or result.schedule.digest(),
        }
        trace = {"schemaVersion": 1, "megatron_slim": meta, "baseTimeNanoseconds": base_ns, "traceEvents": events}
        (directory / f"rank_{rank:03d}.trace.json").write_text(json.dumps(trace))
    return result


def test_a_measured_run_equal_to_the_simulation_compares_equal(tmp_path, capsys):
    result = _fake_traces(tmp_path / "prof")
    out, png = tmp_path / "overlay.json", tmp_path / "overlay.png"
    assert (
        main(
            [
                "overlay",
                "--measured",
                str(tmp_path / "prof"),
                "--set",
                *SETS,
                "--set",
                "train.iters=3",
                "--json",
                str(out),
                "--plot",
                str(png),
            ]
        )
        == 0
    )
    payload = json.loads(out.read_text())
    assert payload["iteration"] == 3 and payload["run_id"] == "abc123"
    assert len(payload["ranks"]) == 4
    for row, sim in zip(payload["ranks"], result.ranks):
        assert row["simulated_busy_s"] == sim.busy_s > 0
        assert row["measured_busy_s"] == pytest.approx(sim.busy_s, rel=1e-6)
    assert payload["measured"]["pipeline_time_s"] == pytest.approx(result.pipeline_time_s, rel=1e-6)
    assert payload["measured"]["bubble_ratio"] == pytest.approx(result.bubble_ratio, abs=1e-6)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = capsys.readouterr().out
    assert "rank 3 busy" in text and "pipeline time" in text and "1.00" in text


def test_trace_files_may_be_named_one_by_one(tmp_path, capsys):
    _fake_traces(tmp_path / "prof")
    files = sorted(str(p) for p in (tmp_path / "prof").glob("rank_00[0-3].trace.json"))
    assert main(["overlay", "--measured", *files, "--set", *SETS, "--json", "-"]) == 0
    assert len(json.loads(capsys.readouterr().out)["ranks"]) == 4


def _refused(argv, capsys, *needles):
    assert main(["overlay", *argv]) == 2
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err, err


def test_missing_or_foreign_traces_are_refused(tmp_path, capsys):
    _refused(["--measured", str(tmp_path / "nowhere")], capsys, "no such file or directory")
    (tmp_path / "empty").mkdir()
    _refused(["--measured", str(tmp_path / "empty")], capsys, "no rank_*.trace.json in this directory")
    (tmp_path / "bad.json").write_bytes(b"\xff\xfe not json")
    _refused(["--measured", str(tmp_path / "bad.json")], capsys, "cannot read it as a JSON trace")
    (tmp_path / "plain.json").write_text(json.dumps({"traceEvents": []}))
    _refused(["--measured", str(tmp_path / "plain.json")], capsys, "not a trace of `megatron-slim train --profile`")
    (tmp_path / "old.json").write_text(json.dumps({"traceEvents": [], "megatron_slim": {"rank": 0}}))
    _refused(["--measured", str(tmp_path / "old.json")], capsys, "'megatron_slim' entry lacks cp_rank, dp_rank")


def test_incomplete_or_mixed_runs_are_refused(tmp_path, capsys):
    _fake_traces(tmp_path / "prof")
    (tmp_path / "prof" / "rank_002.trace.json").unlink()
    _refused(["--measured", str(tmp_path / "prof"), "--set", *SETS], capsys, "no trace of pipeline rank(s) [2]")
    _fake_traces(tmp_path / "other", run_id="zzz999")
    _refused(
        ["--measured", str(tmp_path / "prof"), str(tmp_path / "other"), "--set", *SETS],
        capsys,
        "come from 2 different runs (abc123, zzz999)",
    )


def test_a_recipe_other_than_the_traced_one_is_refused(tmp_path, capsys):
    _fake_traces(tmp_path / "prof")
    _refused(
        ["--measured", str(tmp_path / "prof")],
        capsys,
        "differs from the traced run's recipe",
        "parallel.dp (traced 2, given 1)",
    )
    _refused(
        ["--measured", str(tmp_path / "prof"), "--set", *SETS, "model.hidden_size=256"],
        capsys,
        "model.hidden_size (traced 128, given 256)",
    )
    _fake_traces(tmp_path / "old", digest="0123456789abcdef")
    _refused(["--measured", str(tmp_path / "old"), "--set", *SETS], capsys, "digest 0123456789abcdef")


def test_an_unwritable_plot_is_refused_before_the_simulation(tmp_path, capsys):
    _fake_traces(tmp_path / "prof")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    _refused(
        ["--measured", str(tmp_path / "prof"), "--set", *SETS, "--plot", str(blocker / "o.png")],
        capsys,
        f"--plot {blocker / 'o.png'}: cannot write",
    )
