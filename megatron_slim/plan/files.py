"""Reading the project's input files (recipes, hardware profiles, calibration and lengths files):
UTF-8 text and YAML whose every problem is a ``ConfigError`` naming the flag or field and the file;
the probe that proves an output directory takes new files; and writing an output in one rename.

YAML mappings may not repeat a key: PyYAML keeps the last value silently, which would let a recipe
say ``lr`` twice and train with whichever came last. YAML aliases are refused and a YAML file may
hold at most ``MAX_YAML_BYTES``: PyYAML expands every alias when it builds the data, so a 1.2 KB file
of nested aliases needs gigabytes before any check runs (and a 31 MB recipe takes minutes).
"""

from __future__ import annotations

import contextlib
import glob
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

import yaml

from megatron_slim.plan.schema import ConfigError

MAX_YAML_BYTES = 1 << 20  # recipes, hardware profiles and calibrations are a few KB


def read_text(path: Path, where: str) -> str:
    """The file's text; ``where`` (e.g. ``--recipe x.yaml``) names it in any error."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read ({exc.strerror or exc}; allowed: a readable file)") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise ConfigError(
            f"{where}: not UTF-8 text (byte {data[exc.start]:#04x} at line {line}; allowed: a UTF-8 text file)"
        ) from None


class _UniqueKeyLoader(yaml.SafeLoader):
    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()  # type: ignore[no-untyped-call]
            raise yaml.composer.ComposerError(
                None,
                None,
                f"alias *{event.anchor}; allowed: no anchors or aliases, each value written out",
                event.start_mark,
            )
        return super().compose_node(parent, index)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key {key!r} appears twice (lines {seen[key]} and {line}); allowed: each key once",
                    key_node.start_mark,
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def parse_yaml(text: str, where: str) -> Any:
    """``text`` as YAML (safe types only, no repeated keys, no aliases, at most ``MAX_YAML_BYTES``)."""
    size = len(text.encode("utf-8"))
    if size > MAX_YAML_BYTES:
        raise ConfigError(f"{where}: {size} bytes of YAML; allowed: at most {MAX_YAML_BYTES} bytes")
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.MarkedYAMLError as exc:  # the problem and where, without PyYAML's source excerpt
        mark = exc.problem_mark or exc.context_mark
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{where}: not valid YAML{at}: {exc.problem or exc.context}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: not valid YAML ({' '.join(str(exc).split())})") from None


def load_yaml_mapping(path: Path, where: str) -> dict[str, Any]:
    """A YAML file whose top level is a mapping (an empty file is an empty mapping)."""
    data = parse_yaml(read_text(path, where), where)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of keys to values at the top level (got {type(data).__name__})")
    return data


def write_atomically(path: str | Path, content: str | bytes | Callable[[Path], None], flag: str) -> None:
    """Replace the file at ``path`` with ``content`` in one rename (``replace_atomically``); a write
    that fails (a full disk) is a ``ConfigError`` naming ``flag``, the path and the reason."""
    try:
        replace_atomically(path, content)
    except OSError as exc:
        raise ConfigError(
            f"{flag} {path}: could not be written ({exc.strerror or exc}); the file there before is unchanged"
        ) from None


def replace_atomically(path: str | Path, content: str | bytes | Callable[[Path], None]) -> None:
    """Replace the file at ``path`` with ``content`` in one rename: a reader (or a later run after a
    full disk or a kill) finds the old file or the whole new one, never a part of it.

    ``content`` is text, bytes, or a function that writes the file it is given (a plot). The data goes
    to ``.NAME.tmp<pid>`` beside ``path``, which is removed on any failure; leftovers of writers that
    no longer run (killed outright) are removed first. An ``OSError`` (a full disk) propagates, with
    the previous file unchanged.
    """
    path = Path(path)
    _remove_stale_temporaries(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        if callable(content):
            content(tmp)
        else:
            with open(tmp, "wb") as f:
                f.write(content.encode("utf-8") if isinstance(content, str) else content)
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def _remove_stale_temporaries(path: Path) -> None:
    for stale in path.parent.glob(f".{glob.escape(path.name)}.tmp*"):
        pid = stale.name.rsplit(".tmp", 1)[1]
        if pid.isdigit() and not _running(int(pid)):
            with contextlib.suppress(OSError):
                stale.unlink()


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def probe_new_file(directory: Path, prefix: str, suffix: str = "") -> None:
    """Create and remove an empty file in ``directory``; ``OSError`` where that is not allowed."""
    fd, probe = tempfile.mkstemp(dir=directory, prefix=prefix, suffix=suffix)
    os.close(fd)
    os.unlink(probe)
