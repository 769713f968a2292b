"""A real ``megatron-slim train`` run with ``--tensorboard-dir`` and ``--profile``: the TensorBoard
event file it writes is read back (Megatron's tag names, the run's own losses), the torch profiler
traces carry the simulator's action names, and ``megatron-slim overlay`` accepts them."""

import json

import pytest

from megatron_slim.cli import main
from megatron_slim.commands.simulate import run_one
from megatron_slim.plan.recipe import load_recipe
from tests.overrides import once_per_key
from tests.train.conftest import SMALL_DATA

pytestmark = pytest.mark.multi  # a train run on its ranks

SETS = [
    "train.iters=2",
    "parallel.pp=2",
    "train.global_batch_size=4",
    "model.seq_length=128",
    "schedule.num_slices=2",
    "train.warmup_iters=1",
]


def test_train_writes_tensorboard_events_and_traces_that_overlay_reads(tmp_path, data_cache, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb, prof, out = tmp_path / "tb", tmp_path / "prof", tmp_path / "train.json"
    sets = once_per_key(f"data.cache_dir={data_cache}", *SMALL_DATA, *SETS)
    assert (
        main(
            [
                "train",
                "--set",
                *sets,
                "--json",
                str(out),
                "--tensorboard-dir",
                str(tb),
                "--profile",
                str(prof),
                "--profile-iteration",
                "2",
            ]
        )
        == 0
    )
    summary = json.loads(out.read_text())

    assert list(tb.glob("events.out.tfevents.*")), list(tb.iterdir())
    events = EventAccumulator(str(tb))
    events.Reload()
    assert {
        "lm loss",
        "grad-norm",
        "learning-rate",
        "tokens-per-second",
        "mem-peak-activation-bytes",
        "iteration-time",
        "throughput",
    } <= set(events.Tags()["scalars"])
    logged = [(e.step, e.value) for e in events.Scalars("lm loss")]
    assert [step for step, _ in logged] == [1, 2]
    assert [value for _, value in logged] == pytest.approx(summary["losses"], rel=1e-6)  # float32 in the file
    assert all(e.value > 0 for e in events.Scalars("grad-norm"))
    assert all(e.value > 0 for e in events.Scalars("mem-peak-activation-bytes"))

    traces = sorted(prof.glob("rank_*.trace.json"))
    assert [t.name for t in traces] == ["rank_000.trace.json", "rank_001.trace.json"]
    simulated = run_one(load_recipe("tiny-cpu", sets)).result
    for rank, path in enumerate(traces):
        trace = json.loads(path.read_text())
        meta = trace["megatron_slim"]
        if isinstance(meta, str):
            meta = json.loads(meta)
        assert meta["iteration"] == 2 and meta["pp_rank"] == rank
        assert meta["schedule_digest"] == simulated.schedule.digest()
        names = {e["name"] for e in trace["traceEvents"] if e.get("cat") == "user_annotation"}
        expected = {e.name for e in simulated.events if e.rank == rank}
        assert expected and expected <= names, sorted(expected - names)[:5]

    capsys.readouterr()
    overlay = tmp_path / "overlay.json"
    assert (
        main(
            [
                "overlay",
                "--measured",
                str(prof),
                "--set",
                *sets,
                "--json",
                str(overlay),
                "--plot",
                str(tmp_path / "overlay.png"),
            ]
        )
        == 0
    )
    rows = json.loads(overlay.read_text())["ranks"]
    assert len(rows) == 2 and all(row["measured_busy_s"] > 0 and row["simulated_busy_s"] > 0 for row in rows)
    assert (tmp_path / "overlay.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
