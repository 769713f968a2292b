"""Outputs (``--json``, ``--trace``, ``--plot``) are replaced in one rename: a full disk or a kill
mid-write leaves the previous file whole, names the file that could not be written, and leaves no
temporary file behind."""

import errno
import os
import subprocess
import sys

import pytest

from megatron_slim.plan.files import write_atomically
from megatron_slim.plan.schema import ConfigError


def test_a_write_replaces_the_file_whole(tmp_path):
    path = tmp_path / "out.json"
    path.write_text("old")
    write_atomically(path, '{"new": 1}\n', "--json")
    assert path.read_text() == '{"new": 1}\n' and os.listdir(tmp_path) == ["out.json"]


def test_a_full_disk_names_the_file_and_keeps_the_previous_one(tmp_path):
    path = tmp_path / "out.json"
    path.write_text("the previous run's results")

    def no_space(tmp):
        tmp.write_text("half of it")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(ConfigError) as failed:
        write_atomically(path, no_space, "--json")
    assert str(failed.value) == (
        f"--json {path}: could not be written (No space left on device); the file there before is unchanged"
    )
    assert path.read_text() == "the previous run's results" and os.listdir(tmp_path) == ["out.json"]


def test_a_temporary_file_of_a_killed_writer_is_removed_by_the_next_write(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    left = tmp_path / f".out.json.tmp{int(dead.stdout)}"
    left.write_text("a killed writer's part")
    mine = tmp_path / f".out.json.tmp{os.getpid()}x"  # not a pid: never touched
    mine.write_text("")
    write_atomically(tmp_path / "out.json", "{}", "--json")
    assert sorted(os.listdir(tmp_path)) == sorted(["out.json", mine.name])
