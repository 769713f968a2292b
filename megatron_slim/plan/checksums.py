"""Sizes and SHA-256 checksums of the files in a folder, and the first file that no longer matches:
what a checkpoint's manifest (``train.checkpoint.layout``) and a corpus cache entry's metadata
(``data.cache``) record when written and check when opened. Each caller words the mismatch."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def file_checksums(folder: Path, skip: tuple[str, ...] = ()) -> dict[str, dict[str, Any]]:
    """``{name: {"bytes", "sha256"}}`` of every file in ``folder`` (not in sub-folders) but ``skip``."""
    return {
        p.name: {"bytes": p.stat().st_size, "sha256": sha256_of(p)}
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name not in skip
    }


@dataclass(frozen=True)
class Mismatch:
    name: str
    what: str  # "missing", "bytes" (then ``found`` and ``recorded`` are sizes) or "sha256"
    found: Any = None
    recorded: Any = None


def first_mismatch(folder: Path, recorded: dict[str, Any]) -> Optional[Mismatch]:
    """The first file (by name) of ``recorded`` that ``folder`` lacks or holds otherwise; None: all match."""
    for name, want in sorted(recorded.items()):
        path = folder / name
        if not path.is_file():
            return Mismatch(name, "missing")
        size = path.stat().st_size
        if size != want.get("bytes"):
            return Mismatch(name, "bytes", size, want.get("bytes"))
        if sha256_of(path) != want.get("sha256"):
            return Mismatch(name, "sha256")
    return None
