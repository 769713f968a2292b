"""`megatron-slim train` on CPU ranks: memory measured at run time against the simulator and 1F1B,
and a stopped-and-resumed run continuing with the same losses."""
import json

import pytest

from megatron_slim.cli import main
from tests.train.conftest import SMALL_DATA


def _train(tmp_path, name, data_cache, *sets, extra=()):
    out = tmp_path / f"{name}.json"
    argv = ["train", "--set", f"data.cache_dir={data_cache}", *SMALL_DATA, *sets, "--json", str(out), *extra]
    assert main(argv) == 0
    return json.loads(out.read_text())


def _simulate(tmp_path, name, *sets):
    out = tmp_path / f"{name}.sim.json"
    assert main(["simulate", "--recipe", "tiny-cpu", "--set", *sets, "--json", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.mark.multi
def test_slimpipe_stage0_memory_is_half_of_1f1b_and_matches_the_simulator(tmp_path, data_cache):
    """pp=4, 8 slices, 8 microbatches (tiny-cpu): stage-0 peak activations measured by counting the
    tensors autograd saves must be <= 1/2 of 1F1B's and within 15% of the simulator's prediction."""
    common = ["train.iters=1", "parallel.pp=4", "train.global_batch_size=8"]
    slim = _train(tmp_path, "slim", data_cache, *common, "schedule.kind=slimpipe", "schedule.num_slices=8")
    base = _train(tmp_path, "1f1b", data_cache, *common, "schedule.kind=1f1b", "schedule.num_slices=1")
    assert len(slim["stages"]) == 4 and {"stage", "peak_activation_bytes", "peak_kv_bytes"} <= set(slim["stages"][0])
    slim0, base0 = slim["stages"][0]["peak_activation_bytes"], base["stages"][0]["peak_activation_bytes"]
    assert slim0 <= 0.5 * base0
    sim = _simulate(tmp_path, "slim", *common, "schedule.kind=slimpipe", "schedule.num_slices=8")
    for measured, predicted in zip(slim["stages"], sim["ranks"]):
        assert abs(measured["peak_activation_bytes"] - predicted["peak_activation_bytes"]) <= \
            0.15 * predicted["peak_activation_bytes"]
        assert abs(measured["peak_kv_bytes"] - predicted["peak_kv_bytes"]) <= 0.15 * predicted["peak_kv_bytes"]
    sim_base = _simulate(tmp_path, "1f1b", *common, "schedule.kind=1f1b", "schedule.num_slices=1")
    sim_base0 = sim_base["ranks"][0]["peak_activation_bytes"]
    assert abs(base0 - sim_base0) <= 0.15 * sim_base0


@pytest.mark.multi
def test_stopped_and_resumed_run_continues_with_the_same_losses(tmp_path, data_cache):
    sets = ["train.iters=5", "parallel.pp=2", "train.global_batch_size=4", "model.seq_length=128",
            "train.warmup_iters=1"]
    full = _train(tmp_path, "full", data_cache, *sets)
    ckpt = str(tmp_path / "ckpt")
    first = _train(tmp_path, "first", data_cache, *sets, extra=["--checkpoint-dir", ckpt, "--exit-interval", "2"])
    assert first["last_iteration"] == 2 and first["losses"] == full["losses"][:2]
    second = _train(tmp_path, "second", data_cache, *sets, extra=["--checkpoint-dir", ckpt])
    assert second["resumed_from"] == 2
    assert second["loss_iterations"] == [1, 2, 3, 4, 5]
    assert second["losses"] == pytest.approx(full["losses"], rel=0, abs=1e-6)
    assert full["losses"][-1] < full["losses"][0]
    changed = ["train.iters=5", "parallel.pp=2", "train.global_batch_size=4", "model.seq_length=128",
               "train.warmup_iters=1", "train.lr=1e-4"]
    assert main(["train", "--set", f"data.cache_dir={data_cache}", *SMALL_DATA, *changed,
                 "--checkpoint-dir", ckpt]) == 2


def test_an_unwritable_json_path_fails_before_training(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["train", "--json", str(blocker / "train.json")]) == 2
    captured = capsys.readouterr()
    assert f"--json {blocker / 'train.json'}: cannot write" in captured.err and "data:" not in captured.out
