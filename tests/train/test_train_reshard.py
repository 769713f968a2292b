"""Checkpoints of `megatron-slim train` load at another pipeline / data-parallel split, and a run
whose `latest` iteration is damaged resumes from the newest intact one (and on the schedule of a
changed `train.iters`)."""

import pytest

from tests.train.test_train_job import _train

pytestmark = pytest.mark.multi  # train runs on their ranks

SETS = ["train.global_batch_size=4", "model.seq_length=128", "train.warmup_iters=1"]
PP2 = ["parallel.pp=2", "parallel.dp=1"]


@pytest.fixture(scope="module")
def pp2_run(tmp_path_factory, data_cache):
    return _train(tmp_path_factory.mktemp("reshard"), "pp2", data_cache, *SETS, *PP2, "train.iters=4")


@pytest.mark.parametrize(
    "split",
    [
        pytest.param(["parallel.pp=4", "parallel.dp=1"], id="pp4-to-pp2"),
        pytest.param(["parallel.pp=2", "parallel.dp=2"], id="pp2dp2-to-pp2dp1", marks=pytest.mark.slow),
        pytest.param(
            ["parallel.pp=2", "parallel.vpp=2", "schedule.kind=interleaved", "schedule.num_slices=1"],
            id="pp2vpp2-to-pp2",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_a_checkpoint_resumes_at_another_split_with_the_losses_of_an_uninterrupted_run(
    tmp_path, data_cache, pp2_run, split
):
    ckpt = str(tmp_path / "ckpt")
    first = _train(
        tmp_path,
        "first",
        data_cache,
        *SETS,
        *split,
        "train.iters=4",
        extra=["--checkpoint-dir", ckpt, "--exit-interval", "2"],
    )
    assert first["last_iteration"] == 2
    assert first["losses"] == pytest.approx(pp2_run["losses"][:2], rel=1e-6, abs=0)  # same start at both splits
    resumed = _train(tmp_path, "resumed", data_cache, *SETS, *PP2, "train.iters=4", extra=["--checkpoint-dir", ckpt])
    assert resumed["resumed_from"] == 2 and resumed["loss_iterations"] == [1, 2, 3, 4]
    assert resumed["losses"] == pytest.approx(pp2_run["losses"], rel=1e-6, abs=0)
    assert pp2_run["losses"][-1] < pp2_run["losses"][0]  # the iterations train


@pytest.mark.slow
def test_a_corrupt_latest_falls_back_and_a_longer_run_continues(tmp_path, data_cache, capsys):
    ckpt = tmp_path / "ckpt"
    first = _train(
        tmp_path,
        "first",
        data_cache,
        *SETS,
        *PP2,
        "train.iters=2",
        "train.save_interval=1",
        extra=["--checkpoint-dir", str(ckpt)],
    )
    shard = sorted((ckpt / "iter_0000002").glob("*.distcp"))[-1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    capsys.readouterr()
    longer = _train(tmp_path, "longer", data_cache, *SETS, *PP2, "train.iters=3", extra=["--checkpoint-dir", str(ckpt)])
    out = capsys.readouterr().out
    assert f"checkpoint: skipped iteration 2: iter_0000002/{shard.name} has" in out
    assert "resuming from iteration 1, the newest intact one" in out
    assert longer["resumed_from"] == 1 and longer["loss_iterations"] == [1, 2, 3]
    assert longer["losses"][0] == first["losses"][0]
    assert (ckpt / "latest").read_text() == "3\n"
