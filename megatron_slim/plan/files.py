"""Reading the project's input files (recipes, hardware profiles, calibration and lengths files):
UTF-8 text and YAML whose every problem is a ``ConfigError`` naming the flag or field and the file;
and the probe that proves an output directory takes new files.

YAML mappings may not repeat a key: PyYAML keeps the last value silently, which would let a recipe
say ``lr`` twice and train with whichever came last.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import yaml

from megatron_slim.plan.schema import ConfigError


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
    """``text`` as YAML (safe types only, no repeated keys)."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
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


def probe_new_file(directory: Path, prefix: str, suffix: str = "") -> None:
    """Create and remove an empty file in ``directory``; ``OSError`` where that is not allowed."""
    fd, probe = tempfile.mkstemp(dir=directory, prefix=prefix, suffix=suffix)
    os.close(fd)
    os.unlink(probe)
