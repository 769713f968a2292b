"""``megatron-slim train``'s metrics and profiling flags: refused before any work when they cannot
work, and the metric writer's tags (Megatron-LM's names) read back from TensorBoard and W&B."""

import json
import sys
import types

import pytest

from megatron_slim.cli import main
from megatron_slim.plan.recipe import load_recipe
from megatron_slim.train.loop import RankReport
from megatron_slim.train.metrics import MetricsOptions, MetricsWriter

MEGATRON_TAGS = {"lm loss", "learning-rate", "grad-norm", "batch-size", "iteration-time", "throughput"}
OWN_TAGS = {"tokens-per-second", "mem-peak-activation-bytes", "mem-peak-kv-bytes"}


def _refused(argv, capsys, *needles):
    assert main(["train", *argv]) == 2
    captured = capsys.readouterr()
    assert "data:" not in captured.out and "recipe tiny-cpu" not in captured.out, "work started"
    for needle in needles:
        assert needle in captured.err, captured.err
    return captured.err


def test_tensorboard_dir_without_tensorboard_names_the_package_and_pip(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if not installed
    _refused(
        ["--tensorboard-dir", str(tmp_path / "tb")],
        capsys,
        "--tensorboard-dir: needs the tensorboard package",
        "pip install 'megatron-slim[metrics]'",
    )


def test_wandb_project_without_wandb_is_refused_before_work(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)
    _refused(["--wandb-project", "slim"], capsys, "--wandb-project: needs the wandb package", "pip install wandb")


@pytest.mark.parametrize("flag,value", [("--wandb-exp-name", "run1"), ("--wandb-save-dir", "w")])
def test_wandb_details_without_a_project_are_refused(flag, value, capsys):
    _refused([flag, value], capsys, f"{flag} {value}: takes effect only with --wandb-project")


@pytest.mark.parametrize("flag", ["--tensorboard-dir", "--profile"])
def test_an_output_directory_that_cannot_be_written_fails_before_work(flag, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    _refused([flag, str(blocker)], capsys, f"{flag} {blocker}: cannot write", "is a file, not a directory")
    _refused([flag, str(blocker / "sub")], capsys, f"{flag} {blocker / 'sub'}: cannot write")


def test_the_profiled_iteration_must_be_one_the_run_trains(tmp_path, capsys):
    d = str(tmp_path / "prof")
    _refused(
        ["--profile", d, "--profile-iteration", "3", "--set", "train.iters=2"],
        capsys,
        "--profile-iteration 3: this run trains iterations 1..2",
        "allowed: 1..2",
    )
    _refused(["--profile", d, "--profile-iteration", "0", "--set", "train.iters=2"], capsys, "allowed: 1..2")
    _refused(["--profile", d, "--profile-iteration", "3", "--exit-interval", "2"], capsys, "allowed: 1..2")
    _refused(["--profile-iteration", "1"], capsys, "--profile-iteration 1: takes effect only with --profile DIR")


def test_a_run_that_resumes_past_the_profiled_iteration_is_refused(tmp_path, capsys):
    from megatron_slim.train.checkpoint.layout import iteration_dir, write_manifest

    ckpt = tmp_path / "ckpt"
    folder = iteration_dir(ckpt, 3)  # an intact (checksummed) iteration 3, weights aside
    folder.mkdir(parents=True)
    (folder / "recipe.json").write_text(json.dumps(load_recipe("tiny-cpu").to_dict()))
    write_manifest(folder, 3)
    (ckpt / "latest").write_text("3\n")
    _refused(
        ["--checkpoint-dir", str(ckpt), "--profile", str(tmp_path / "p"), "--profile-iteration", "2"],
        capsys,
        "--profile-iteration 2: this run trains iterations 4..40 (it resumes from the checkpoint at iteration 3)",
    )


def _report(activation, kv):
    report = RankReport(0, 3, 0, 0)
    report.peak_activation_bytes, report.peak_kv_bytes = activation, kv
    return report


def _log_two_iterations(options):
    recipe = load_recipe("tiny-cpu")
    writer = MetricsWriter(options, recipe)
    writer.log(1, 8.25, 7.5e-4, 2.5, 1.25, _report(100, 10))
    writer.log(2, 8.125, 1.5e-3, 2.0, 0.5, _report(300, 30))
    writer.close()
    return recipe


def test_tensorboard_gets_megatron_tags_each_iteration(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    recipe = _log_two_iterations(MetricsOptions(tensorboard_dir=str(tmp_path)))
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert MEGATRON_TAGS | OWN_TAGS | {"lm loss vs samples", "grad-norm vs samples"} <= tags

    def series(tag):
        return [(e.step, e.value) for e in events.Scalars(tag)]

    gbs, tokens = recipe.train.global_batch_size, recipe.train.global_batch_size * recipe.model.seq_length
    assert series("lm loss") == [(1, 8.25), (2, 8.125)]
    assert series("lm loss vs samples") == [(gbs, 8.25), (2 * gbs, 8.125)]
    assert series("iteration-time") == [(1, 1.25), (2, 0.5)]
    assert series("tokens-per-second") == [(1, pytest.approx(tokens / 1.25)), (2, tokens / 0.5)]
    assert series("mem-peak-activation-bytes") == [(1, 100), (2, 300)]
    assert series("batch-size") == [(1, gbs), (2, gbs)]
    throughput = series("throughput")
    assert throughput[1][1] == pytest.approx(throughput[0][1] * 1.25 / 0.5, rel=1e-6) and throughput[0][1] > 0


def test_wandb_gets_the_same_values_under_the_same_names(monkeypatch, tmp_path):
    calls = []
    fake = types.SimpleNamespace(
        init=lambda **kw: calls.append(("init", kw)),
        log=lambda values, step: calls.append(("log", step, values)),
        finish=lambda: calls.append(("finish",)),
    )
    monkeypatch.setitem(sys.modules, "wandb", fake)
    _log_two_iterations(MetricsOptions(wandb_project="slim", wandb_exp_name="run1", wandb_save_dir=str(tmp_path)))
    init, first, second, finish = calls
    assert init[1]["project"] == "slim" and init[1]["name"] == "run1" and init[1]["dir"] == str(tmp_path)
    assert first[1] == 1 and first[2]["lm loss"] == 8.25 and set(first[2]) >= MEGATRON_TAGS | OWN_TAGS
    assert second[1] == 2 and second[2]["grad-norm"] == 2.0 and finish == ("finish",)
