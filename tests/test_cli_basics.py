"""What a user types first: ``megatron-slim --version``, ``python -m megatron_slim.launch --help``,
and a ``--set`` key given twice (refused, naming the key and both values, before any work)."""

import pytest

from megatron_slim import __version__
from megatron_slim.cli import main
from megatron_slim.launch import main as launch_main


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"megatron-slim {__version__}"


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_the_launcher_explains_itself_and_exits_0(flag, capsys):
    with pytest.raises(SystemExit) as done:
        launch_main([flag])
    out = capsys.readouterr().out
    assert done.value.code == 0 and out.startswith("usage: python -m megatron_slim.launch SCRIPT.py")
    assert "pretrain_gpt.py" in out and "--use-slimpipe" in out


def test_the_launcher_without_a_script_fails_with_its_usage():
    with pytest.raises(SystemExit) as done:
        launch_main([])
    assert str(done.value.code).startswith("usage: python -m megatron_slim.launch")


@pytest.mark.parametrize("command", ["simulate", "megatron-args", "train"])
def test_a_key_set_twice_is_refused_naming_it(command, capsys):
    with pytest.raises(SystemExit) as done:
        main([command, "--recipe", "tiny-cpu", "--set", "parallel.pp=2", "train.iters=3", "--set", "parallel.pp=4"])
    assert done.value.code == 2
    assert "--set parallel.pp: given twice ('2' and '4'); allowed: once" in capsys.readouterr().err
