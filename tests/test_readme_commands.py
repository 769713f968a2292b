"""Every ``megatron-slim`` command shown in README.md's "Using it" section runs as written.

Commands are the lines of the section's fenced code blocks that start with ``megatron-slim``
(continuation lines joined, ``# comments`` dropped) and the section's inline code spans that start
with ``megatron-slim``. Each runs through the CLI entry point (``megatron_slim.cli.main``) in a fresh
temporary working directory, so relative outputs such as ``out/sim.json`` land there, and must exit 0.

``megatron-slim train`` lines take minutes: the slow tier runs them exactly as written; the default
tier runs them with ``--set train.iters=1`` appended (same recipe, flags and outputs, one iteration).
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


def readme_commands() -> list[str]:
    """``megatron-slim`` commands of the "Using it" section, in order of appearance."""
    section = _section(README.read_text(), "Using it")
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


@pytest.mark.parametrize("command", OTHER, ids=_id)
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
