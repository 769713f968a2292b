"""What every command prints: aligned text tables and JSON to a file or to stdout, and the check
that every output path can be written before any work starts."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Optional, Sequence, TextIO

from megatron_slim.plan.files import probe_new_file, write_atomically
from megatron_slim.plan.schema import ConfigError


def format_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(
        [fmt.format(*header), fmt.format(*("-" * w for w in widths)), *(fmt.format(*map(str, r)) for r in rows)]
    )


def emit_json(payload: dict, target: str | None, indent: int = 2) -> TextIO:
    """Write ``payload`` to ``target`` (a path, or ``-`` for stdout) and return the stream human
    output should use: stderr when stdout carries the JSON."""
    if target:
        text = json.dumps(payload, indent=indent)
        if target == "-":
            print(text)
        else:
            write_atomically(target, text + "\n", "--json")
    return sys.stderr if target == "-" else sys.stdout


def prepare_outputs(*outputs: tuple[str, Optional[str]], stdout_ok: Sequence[str] = ("--json",)) -> None:
    """Before any work: every ``(flag, path)`` given can be written. Missing parent directories are
    created (``--json out/sim.json`` works on a fresh clone); a path that is a directory, lies under
    a file, cannot be created or opened, or is also another flag's output fails naming the flag and
    the path. ``-`` (stdout) is allowed for the flags in ``stdout_ok``."""
    seen: dict[Path, str] = {}
    for flag, target in outputs:
        if target is None:
            continue
        if target == "-":
            if flag in stdout_ok:
                continue
            raise ConfigError(f"{flag} -: cannot write this output to stdout (allowed: a file path)")
        path = Path(target)
        key = path.resolve()
        if key in seen:
            raise ConfigError(
                f"{flag} {target}: cannot write: {seen[key]} writes the same file "
                "(allowed: a different path for each output)"
            )
        seen[key] = flag
        _check_writable(flag, target, path)


# flags whose file is a PNG image (written to exactly the path given)
IMAGE_FLAGS = ("--plot",)


def _check_writable(flag: str, target: str, path: Path) -> None:
    def fail(reason: str) -> ConfigError:
        return ConfigError(
            f"{flag} {target}: cannot write ({reason}); allowed: a file path in a "
            "writable directory (missing directories are created)"
        )

    if target == "" or path.is_dir() or target.endswith(("/", os.sep)):
        raise fail("it is a directory" if target else "empty path")
    existing = next(p for p in (path.parent, *path.parent.parents) if p.exists() or p == p.parent)
    if existing.exists() and not existing.is_dir():
        raise fail(f"{existing} is a file, not a directory")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise fail(f"cannot create directory {path.parent}: {exc.strerror or exc}") from None
    try:
        if path.exists():
            with open(path, "a"):
                pass
        else:
            probe_new_file(path.parent, prefix=f".{path.name}.", suffix=".probe")
    except OSError as exc:
        raise fail(exc.strerror or str(exc)) from None
    if flag in IMAGE_FLAGS and path.suffix.lower() not in ("", ".png"):
        raise ConfigError(f"{flag} {target}: a PNG image; allowed: a path ending in .png (or with no suffix)")
    if flag in IMAGE_FLAGS and importlib.util.find_spec("matplotlib") is None:
        raise ConfigError(
            f"{flag} {target}: drawing needs matplotlib, which is not installed; "
            "allowed: pip install 'megatron-slim[plot]' (or matplotlib), or no --plot"
        )


def prepare_output_dirs(*outputs: tuple[str, Optional[str]]) -> None:
    """Before any work: every ``(flag, directory)`` given is a directory that exists or can be
    created (it is, with its parents) and in which files can be created; otherwise a named error."""
    for flag, target in outputs:
        if target is None:
            continue
        path = Path(target)

        def fail(reason: str) -> ConfigError:  # raised within this iteration, so never late-bound
            return ConfigError(
                f"{flag} {target}: cannot write ({reason}); allowed: a writable directory "  # noqa: B023
                "(missing directories are created)"
            )

        if target in ("", "-"):
            raise fail("not a directory path")
        existing = next(p for p in (path, *path.parents) if p.exists() or p == p.parent)
        if existing.exists() and not existing.is_dir():
            raise fail(f"{existing} is a file, not a directory")
        try:
            path.mkdir(parents=True, exist_ok=True)
            probe_new_file(path, prefix=".probe.")
        except OSError as exc:
            raise fail(exc.strerror or str(exc)) from None
