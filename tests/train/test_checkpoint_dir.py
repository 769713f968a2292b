"""A checkpoint directory judged before any work (single process, no ranks): a damaged ``latest``
iteration falls back to the newest intact one with one line saying so; a directory with nothing
intact, a foreign recipe or a file in place of the directory is a named error."""

import json

import pytest

from megatron_slim.cli import main
from megatron_slim.plan.recipe import load_recipe
from megatron_slim.plan.schema import ConfigError
from megatron_slim.train.checkpoint import CHANGEABLE, check_checkpoint_dir, check_resumable
from megatron_slim.train.checkpoint.layout import iteration_dir, write_atomic, write_manifest

SETS = ["train.iters=4", "data.max_files=60"]


def _recipe(*sets):
    return load_recipe("tiny-cpu", [*SETS, *sets]).to_dict()


def _save_fake(directory, iteration, recipe, *, latest=True):
    """An iteration folder as ``store.save`` leaves it (shard contents do not matter here)."""
    folder = iteration_dir(directory, iteration)
    folder.mkdir(parents=True)
    (folder / ".metadata").write_bytes(b"metadata %d" % iteration)
    (folder / "__0_0.distcp").write_bytes(bytes(range(256)) * 8)
    write_atomic(folder / "recipe.json", json.dumps(recipe))
    write_manifest(folder, iteration)
    if latest:
        write_atomic(directory / "latest", f"{iteration}\n")
    return folder


@pytest.fixture
def saved(tmp_path):
    """Iterations 1 and 2 of tiny-cpu, ``latest`` = 2."""
    recipe = _recipe()
    _save_fake(tmp_path, 1, recipe)
    _save_fake(tmp_path, 2, recipe)
    return tmp_path, recipe


def _resume(directory, recipe):
    lines = []
    return check_resumable(str(directory), recipe, say=lines.append), lines


def test_an_intact_latest_resumes_silently(saved):
    directory, recipe = saved
    assert _resume(directory, recipe) == (2, [])


def test_an_empty_directory_starts_from_scratch(tmp_path):
    assert _resume(tmp_path, _recipe()) == (None, [])


def _truncate(path):
    path.write_bytes(path.read_bytes()[:100])


def _flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[17] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGE = {
    "truncated shard": (
        lambda d: _truncate(d / "iter_0000002" / "__0_0.distcp"),
        "iter_0000002/__0_0.distcp has 100 bytes, the manifest says 2048",
    ),
    "corrupt shard": (
        lambda d: _flip_a_byte(d / "iter_0000002" / "__0_0.distcp"),
        "iter_0000002/__0_0.distcp does not match its sha256",
    ),
    "missing recipe.json": (
        lambda d: (d / "iter_0000002" / "recipe.json").unlink(),
        "iter_0000002/recipe.json is missing",
    ),
    "latest names a missing iteration": (
        lambda d: (d / "latest").write_text("7\n"),
        "iteration 7: iter_0000007 is missing",
    ),
    "garbage latest": (lambda d: (d / "latest").write_text("\x00garbage"), "latest holds '\\x00garbage'"),
    "no manifest": (lambda d: (d / "iter_0000002" / "manifest.json").unlink(), "iter_0000002 has no manifest.json"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_latest_falls_back_to_the_newest_intact_iteration(saved, case):
    directory, recipe = saved
    damage, reason = DAMAGE[case]
    damage(directory)
    expected = 2 if case in ("garbage latest", "latest names a missing iteration") else 1
    found, lines = _resume(directory, recipe)
    assert found == expected
    assert len(lines) == 1 and reason in lines[0] and f"resuming from iteration {expected}" in lines[0]


def test_nothing_intact_is_a_named_error(tmp_path):
    folder = _save_fake(tmp_path, 3, _recipe())
    _truncate(folder / "__0_0.distcp")
    with pytest.raises(
        ConfigError,
        match=r"--checkpoint-dir .*: no intact checkpoint to resume from "
        r"\(iteration 3: iter_0000003/__0_0.distcp has 100 bytes.*--no-resume",
    ):
        _resume(tmp_path, _recipe())


def test_a_checkpoint_of_the_old_per_rank_format_is_a_named_error(tmp_path):
    (tmp_path / "iter_0000002").mkdir()
    (tmp_path / "iter_0000002" / "rank_000.pt").write_bytes(b"old")
    (tmp_path / "latest").write_text("2\n")
    with pytest.raises(ConfigError, match="iter_0000002 has no manifest.json .*not a megatron-slim"):
        _resume(tmp_path, _recipe())


def test_a_foreign_recipe_names_what_differs_and_what_may_change(saved):
    directory, _ = saved
    with pytest.raises(ConfigError) as error:
        _resume(directory, _recipe("model.hidden_size=64", "parallel.tp=2"))
    message = str(error.value)
    assert "differs in: model.hidden_size, parallel.tp)" in message
    assert all(key in message for key in CHANGEABLE)


def test_the_pipeline_and_data_parallel_split_may_change(saved):
    directory, _ = saved
    assert _resume(directory, _recipe("parallel.pp=2", "parallel.dp=2", "train.iters=6"))[0] == 2


def test_a_checkpoint_past_train_iters_is_a_named_error(saved):
    directory, _ = saved
    with pytest.raises(ConfigError, match=r"train.iters: got 1, .* holds iteration 2; allowed: train.iters >= 2"):
        _resume(directory, _recipe("train.iters=1"))


def test_a_file_as_checkpoint_dir_is_a_named_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match=r"--checkpoint-dir .*a-file: it is a file, not a directory; allowed: "):
        check_checkpoint_dir(str(blocker))
    with pytest.raises(ConfigError, match=r"--checkpoint-dir .*a-file/sub: cannot write there"):
        check_checkpoint_dir(str(blocker / "sub"))


def test_train_refuses_a_file_as_checkpoint_dir_before_any_work(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["train", "--checkpoint-dir", str(blocker), "--no-resume"]) == 2
    captured = capsys.readouterr()
    assert f"--checkpoint-dir {blocker}: it is a file" in captured.err and "data:" not in captured.out


def test_train_refuses_a_directory_with_nothing_intact_before_any_work(tmp_path, capsys):
    (tmp_path / "latest").write_text("garbage")
    assert main(["train", "--checkpoint-dir", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert "no intact checkpoint to resume from (latest holds 'garbage'" in captured.err
    assert "data:" not in captured.out


def test_a_second_run_on_a_checkpoint_directory_in_use_refuses_naming_the_first(tmp_path, capsys):
    """Two runs on one directory would interleave their checkpoints; the second refuses before any
    work, naming the holder, and the directory is free again when the first ends."""
    import os
    import socket

    from megatron_slim.train.checkpoint.lock import LOCK_FILE, only_run_in

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    with only_run_in(str(ckpt)):
        assert f"pid {os.getpid()}" in (ckpt / LOCK_FILE).read_text()
        assert main(["train", "--checkpoint-dir", str(ckpt), "--set", *SETS]) == 2
        err = capsys.readouterr().err
        assert (
            f"--checkpoint-dir {ckpt}: another run is training into it (host {socket.gethostname()}, pid {os.getpid()}"
            in err
        )
        with pytest.raises(ConfigError, match="another run is training into it"), only_run_in(str(ckpt)):
            pass
    with only_run_in(str(ckpt)):  # released
        pass
    assert sorted(p.name for p in ckpt.iterdir()) == [LOCK_FILE]
