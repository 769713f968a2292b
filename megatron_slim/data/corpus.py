"""Deterministic listing and reading of a text corpus.

Two sources:

- ``"stdlib"``: the ``.py`` sources of the running Python's standard library
  (``sysconfig.get_paths()["stdlib"]``), without ``site-packages``/``dist-packages``. It is a real,
  varied text corpus (~30 MB of code and prose for CPython 3.11) present on every machine.
- a directory: every text file under it, hidden entries (``.git``...) and ``__pycache__`` skipped.

Files are taken in sorted order of their POSIX relative path; unreadable, non-UTF-8, binary
(NUL bytes) and empty files are skipped. The fingerprint hashes the relative paths and bytes of
exactly the documents read, so it changes whenever the corpus content does.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

STDLIB = "stdlib"
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


@dataclass(frozen=True)
class Document:
    relpath: str
    text: str


@dataclass(frozen=True)
class Corpus:
    """The documents of one corpus, in order, with a content fingerprint."""

    source: str
    root: Path
    documents: tuple[Document, ...]
    fingerprint: str
    num_bytes: int

    def texts(self) -> Iterator[str]:
        return (doc.text for doc in self.documents)

    def __len__(self) -> int:
        return len(self.documents)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_corpus(
    source: str | os.PathLike = STDLIB, *, max_files: int = 0, max_bytes: int = 0, suffixes: Sequence[str] | None = None
) -> Corpus:
    """Read the corpus ``source`` (``"stdlib"`` or a directory path).

    ``max_files`` / ``max_bytes`` (0 = no bound) keep the first documents in order until either
    bound is reached. ``suffixes`` (e.g. ``(".py", ".md")``) filters file names; the default is
    ``(".py",)`` for the stdlib and every file for a directory.
    """
    for name, value in (("max_files", max_files), ("max_bytes", max_bytes)):
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}={value!r}: must be an integer >= 0 (0 means no bound)")
    if str(source) == STDLIB:
        root = stdlib_root()
        suffixes = (".py",) if suffixes is None else suffixes
    else:
        root = Path(source).expanduser()
        if not root.is_dir():
            raise ValueError(f"corpus={str(source)!r}: must be {STDLIB!r} or an existing directory")
    root = root.resolve()
    documents: list[Document] = []
    digest = hashlib.sha256()
    total = 0
    for relpath in _sorted_relpaths(root, tuple(suffixes) if suffixes else None):
        content = _read_text(root / relpath)
        if content is None:
            continue
        data, text = content
        if max_bytes and total + len(data) > max_bytes and documents:
            break
        documents.append(Document(relpath, text))
        digest.update(f"{len(relpath)}:{relpath}:{len(data)}:".encode())
        digest.update(data)
        total += len(data)
        if max_files and len(documents) >= max_files:
            break
    if not documents:
        raise ValueError(f"corpus={str(source)!r}: no readable UTF-8 text files found under {root}")
    return Corpus(str(source), root, tuple(documents), digest.hexdigest(), total)


def _sorted_relpaths(root: Path, suffixes: tuple[str, ...] | None) -> list[str]:
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIPPED_DIRS and not d.startswith(".")]
        rel_dir = Path(dirpath).relative_to(root)
        for name in filenames:
            if name.startswith(".") or (suffixes and not name.endswith(suffixes)):
                continue
            found.append((rel_dir / name).as_posix())
    return sorted(found)


def _read_text(path: Path) -> tuple[bytes, str] | None:
    """The file's bytes and text if it is a non-empty UTF-8 text file, else ``None``."""
    try:
        data = path.read_bytes()
        text = data.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    if not data or "\x00" in text:
        return None
    return data, text
