"""`megatron-slim train` on CPU ranks: memory measured at run time against the simulator and 1F1B,
and a stopped-and-resumed run continuing with the same losses."""

import json

import pytest

from megatron_slim.cli import main
from tests.overrides import once_per_key
from tests.train.conftest import SMALL_DATA


def _train(tmp_path, name, data_cache, *sets, extra=()):
    out = tmp_path / f"{name}.json"
    argv = [
        "train",
        "--set",
        *once_per_key(f"data.cache_dir={data_cache}", *SMALL_DATA, *sets),
        "--json",
        str(out),
        *extra,
    ]
    assert main(argv) == 0
    return json.loads(out.read_text())


def _simulate(tmp_path, name, *sets):
    out = tmp_path / f"{name}.sim.json"
    assert main(["simulate", "--recipe", "tiny-cpu", "--set", *sets, "--json", str(out)]) == 0
    return json.loads(out.read_text())


SEQ, HIDDEN, PP = 512, 128, 4  # tiny-cpu (micro batch 1) at parallel.pp=4
# microbatches with tensors saved at each end stage's activation peak: 1F1B's stage 0 holds its pp
# warm-up microbatches, its last stage one; SlimPipe's stage 0 peak spans 3 microbatches' slices,
# its last stage's one microbatch's worth of slices from 2 microbatches (it interleaves them)
IN_FLIGHT = {"slimpipe": {0: 3, PP - 1: 2}, "1f1b": {0: PP, PP - 1: 1}}


def _unmodelled_bytes(stage: int, microbatches: int) -> int:
    """Bytes autograd saves that the cost model leaves out; it counts every other saved tensor to
    the byte. Stage 0: the embedding's int64 token ids, one whole-microbatch storage per microbatch
    (slices are views of it). Last stage: per token, the final RMSNorm's third h-wide fp32 tensor
    and its fp32 rsqrt, the cross entropy's int64 target and bool mask; plus one fp32 loss-mask
    storage per microbatch. Middle stages: nothing."""
    if stage == 0:
        return microbatches * SEQ * 8
    if stage == PP - 1:
        return SEQ * (HIDDEN * 4 + 4 + 8 + 1) + microbatches * SEQ * 4
    return 0


def _assert_memory_matches(measured_stages, simulated_ranks, kind):
    """K/V bytes (the cache's ByteLedger against the simulator) are equal; saved activations differ
    exactly by what the cost model leaves out."""
    assert [m["stage"] for m in measured_stages] == list(range(PP))
    for stage, (measured, predicted) in enumerate(zip(measured_stages, simulated_ranks)):
        assert measured["peak_kv_bytes"] == predicted["peak_kv_bytes"], (kind, stage)
        unmodelled = _unmodelled_bytes(stage, IN_FLIGHT[kind].get(stage, 0))
        assert measured["peak_activation_bytes"] == predicted["peak_activation_bytes"] + unmodelled, (kind, stage)


@pytest.mark.multi
def test_slimpipe_stage0_memory_is_half_of_1f1b_and_matches_the_simulator(tmp_path, data_cache):
    """pp=4, 8 slices, 8 microbatches (tiny-cpu): stage-0 peak activations measured by counting the
    tensors autograd saves must be <= 1/2 of 1F1B's; on every stage, under both schedules, the
    measured K/V peak equals the simulator's and the activation peak equals it up to the tensors the
    cost model leaves out."""
    common = ["train.iters=1", f"parallel.pp={PP}", "train.global_batch_size=8"]
    schedules = {
        "slimpipe": ["schedule.kind=slimpipe", "schedule.num_slices=8"],
        "1f1b": ["schedule.kind=1f1b", "schedule.num_slices=1"],
    }
    runs = {kind: _train(tmp_path, kind, data_cache, *common, *sets) for kind, sets in schedules.items()}
    slim, base = runs["slimpipe"], runs["1f1b"]
    assert {"stage", "peak_activation_bytes", "peak_kv_bytes"} <= set(slim["stages"][0])
    assert slim["stages"][0]["peak_activation_bytes"] <= 0.5 * base["stages"][0]["peak_activation_bytes"]
    for kind, sets in schedules.items():
        _assert_memory_matches(runs[kind]["stages"], _simulate(tmp_path, kind, *common, *sets)["ranks"], kind)


@pytest.mark.multi
def test_stopped_and_resumed_run_continues_with_the_same_losses(tmp_path, data_cache):
    sets = [
        "train.iters=5",
        "parallel.pp=2",
        "train.global_batch_size=4",
        "model.seq_length=128",
        "train.warmup_iters=1",
    ]
    full = _train(tmp_path, "full", data_cache, *sets)
    ckpt = str(tmp_path / "ckpt")
    first = _train(tmp_path, "first", data_cache, *sets, extra=["--checkpoint-dir", ckpt, "--exit-interval", "2"])
    assert first["last_iteration"] == 2 and first["losses"] == full["losses"][:2]
    second = _train(tmp_path, "second", data_cache, *sets, extra=["--checkpoint-dir", ckpt])
    assert second["resumed_from"] == 2
    assert second["loss_iterations"] == [1, 2, 3, 4, 5]
    assert second["losses"] == pytest.approx(full["losses"], rel=0, abs=1e-6)
    assert full["losses"][-1] < full["losses"][0]
    changed = [
        "train.iters=5",
        "parallel.pp=2",
        "train.global_batch_size=4",
        "model.seq_length=128",
        "train.warmup_iters=1",
        "train.lr=1e-4",
    ]
    assert (
        main(["train", "--set", f"data.cache_dir={data_cache}", *SMALL_DATA, *changed, "--checkpoint-dir", ckpt]) == 2
    )


def test_an_unwritable_json_path_fails_before_training(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["train", "--json", str(blocker / "train.json")]) == 2
    captured = capsys.readouterr()
    assert f"--json {blocker / 'train.json'}: cannot write" in captured.err and "data:" not in captured.out
