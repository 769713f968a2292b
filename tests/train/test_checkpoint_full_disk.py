"""A checkpoint that cannot be written (a full disk): every rank stops after the iteration with one
line naming the folder and the reason, the previous checkpoint and ``latest`` stay as they were,
nothing half-written is left, and the exit status says training stopped. Run on a small tmpfs."""

import json
import subprocess

import pytest

from megatron_slim.cli import main
from megatron_slim.train.checkpoint.layout import choose_iteration, iteration_dir, partial_dir
from tests.train.conftest import SMALL_DATA

pytestmark = pytest.mark.multi  # train runs on its ranks

SMALL_MODEL = ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=176", "model.seq_length=64"]
SETS = [
    *SMALL_DATA,
    *SMALL_MODEL,
    "parallel.pp=2",
    "train.global_batch_size=4",
    "train.iters=3",
    "train.save_interval=1",
]


@pytest.fixture
def small_disk(tmp_path):
    """A 9 MiB tmpfs: one checkpoint of the model below fits, a second one beside it does not."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=9m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}): needs root")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_full_disk_stops_training_and_keeps_the_previous_checkpoint(tmp_path, data_cache, small_disk, capsys):
    ckpt = small_disk / "ckpt"
    out = tmp_path / "train.json"
    code = main(
        ["train", "--checkpoint-dir", str(ckpt), "--set", f"data.cache_dir={data_cache}", *SETS, "--json", str(out)]
    )
    err = capsys.readouterr().err
    assert code == 3, err[-3000:]
    line = err.strip().splitlines()[-1]
    assert line.startswith(
        f"megatron-slim train: error: iteration 2: its checkpoint could not be written to {partial_dir(ckpt, 2)} ("
    )
    assert "No space left on device" in line and line.endswith(
        "the checkpoint of iteration 1 and `latest` are unchanged"
    )
    assert choose_iteration(str(ckpt)).iteration == 1 and iteration_dir(ckpt, 1).is_dir()
    assert not partial_dir(ckpt, 2).exists() and not iteration_dir(ckpt, 2).exists()
    report = json.loads(out.read_text())
    assert report["stopped"] == line.split("error: ", 1)[1] and report["loss_iterations"] == [1, 2]
