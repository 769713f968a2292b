"""Every ``megatron-slim`` command shown in README.md runs as written.

Commands are the lines of the fenced code blocks of the "Using it" section that start with
``megatron-slim`` (continuation lines joined, ``# comments`` dropped) and the inline code spans that
start with ``megatron-slim`` in that section and in the numbered "Your Megatron-LM job" steps. Each
runs through the CLI entry point (``megatron_slim.cli.main``) in a fresh temporary working
directory, so relative outputs such as ``out/sim.json`` land there, and must exit 0.

``megatron-slim train`` lines take minutes: the slow tier runs them exactly as written; the default
tier runs them with ``--set train.iters=1`` appended (same recipe, flags and outputs, one iteration).
The other commands that take more than a few seconds (the autotuner, the big simulations with plots)
run as written in the slow tier only; the default tier runs each one's path at a small size in the
test named in ``LONG``.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from megatron_slim.cli import main

README = Path(__file__).resolve().parents[1] / "README.md"
FAST_TRAIN = ["--set", "train.iters=1"]


def _section(text: str, heading: str) -> str:
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


SECTIONS = ("Your Megatron-LM job with megatron-slim", "Using it")


def readme_commands() -> list[str]:
    """``megatron-slim`` commands of the README's ``SECTIONS``, in order of appearance."""
    text = README.read_text()
    return [c for heading in SECTIONS for c in _section_commands(_section(text, heading))]


def _section_commands(section: str) -> list[str]:
    commands: list[str] = []
    parts = section.split("```")
    for i, part in enumerate(parts):
        if i % 2:  # a fenced block: its first line is the (possibly empty) info string
            joined = re.sub(r"\\\n\s*", " ", part.split("\n", 1)[1] if "\n" in part else "")
            commands += [ln.strip() for ln in joined.splitlines() if ln.strip().startswith("megatron-slim ")]
        else:
            for span in re.findall(r"`([^`]+)`", part):
                span = " ".join(span.split())
                if span.startswith("megatron-slim "):
                    commands.append(span)
    return commands


def _argv(command: str) -> list[str]:
    words = shlex.split(command, comments=True)
    assert words[0] == "megatron-slim", command
    return words[1:]


COMMANDS = readme_commands()
TRAIN = [c for c in COMMANDS if _argv(c)[0] == "train"]
OTHER = [c for c in COMMANDS if _argv(c)[0] != "train"]


def _run(argv: list[str], tmp_path, monkeypatch, capsys, command: str) -> None:
    monkeypatch.chdir(tmp_path)
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 0, f"README command failed (exit {code}): {command}\n{captured.err[-3000:]}"


def test_the_section_documents_every_command():
    kinds = {_argv(c)[0] for c in COMMANDS}
    assert {"recipes", "simulate", "plan", "train", "megatron-args"} <= kinds, COMMANDS
    assert any("--cp-engine" in c for c in COMMANDS), "the Zeppelin simulate example"
    assert all("[" not in " ".join(_argv(c)) and "..." not in " ".join(_argv(c)) for c in COMMANDS), (
        "commands, not synopses"
    )


def _id(command: str) -> str:
    return " ".join(_argv(command))[:80]


# a long command (what it starts with) -> the default-tier test that runs its path at a small size
LONG = {
    "megatron-slim plan ": "tests/plan/test_tune.py::test_plan_json_holds_both_choices_and_the_speedup",
    "megatron-slim simulate --recipe llama2-7b-64k --packing ": "tests/plan/test_cli_packing.py",
    "megatron-slim simulate --recipe zeppelin-7b-h800 --cp-engine all ": (
        "tests/plan/cp/test_cli_cp.py::test_trace_and_plot_show_each_engine_per_rank"
    ),
    "megatron-slim simulate --recipe llama2-70b-512k --compare ": (
        "tests/plan/test_cli_simulate.py::test_compare_prints_a_table_and_json_to_stdout"
    ),
}


def _long(command: str) -> bool:
    return any(command.startswith(prefix) for prefix in LONG)


def test_every_long_command_prefix_still_names_a_readme_command():
    assert all(any(c.startswith(prefix) for c in OTHER) for prefix in LONG), "a LONG entry matches no command"


@pytest.mark.parametrize(
    "command", [pytest.param(c, marks=pytest.mark.slow) if _long(c) else c for c in OTHER], ids=_id
)
def test_readme_command_runs_as_written(command, tmp_path, monkeypatch, capsys):
    _run(_argv(command), tmp_path, monkeypatch, capsys, command)
    if "--json" in command:
        argv = _argv(command)
        for flag in ("--json", "--trace", "--plot"):
            if flag in argv and argv[argv.index(flag) + 1] != "-":
                assert (tmp_path / argv[argv.index(flag) + 1]).stat().st_size > 0, flag


# the default tier skips a train line another one extends (bare `train` runs the default recipe,
# which `train --recipe tiny-cpu ...` names); the slow tier runs every line as written
FAST_TRAIN_LINES = [c for c in TRAIN if not any(o != c and o.startswith(c + " ") for o in TRAIN)]


@pytest.mark.multi
@pytest.mark.parametrize("command", FAST_TRAIN_LINES, ids=_id)
def test_readme_train_command_runs_for_one_iteration(command, tmp_path, monkeypatch, capsys):
    """Default tier: the README's train line with ``--set train.iters=1`` appended."""
    _run(_argv(command) + FAST_TRAIN, tmp_path, monkeypatch, capsys, command)


@pytest.mark.multi
@pytest.mark.slow
@pytest.mark.parametrize("command", TRAIN, ids=_id)
def test_readme_train_command_runs_as_written(command, tmp_path, monkeypatch, capsys):
    _run(_argv(command), tmp_path, monkeypatch, capsys, command)
