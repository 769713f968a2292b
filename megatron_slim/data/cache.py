"""Build-once cache directories that concurrent or interrupted processes never see half-written.

A cache entry is a directory that appears in one ``rename`` only after its content is complete.
While one process builds an entry, the others block on a per-entry ``flock`` and then find it
built, so N ranks starting together tokenize once, not N times. An entry records the size and
SHA-256 of its files (``file_manifest``); a reader checks them (``manifest_problem``) and replaces
an entry damaged on disk since (``rebuild``) instead of training on what is left of it.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from megatron_slim.plan.checksums import file_checksums, first_mismatch

CACHE_ENV = "MEGATRON_SLIM_CACHE"


def default_cache_dir() -> Path:
    """``$MEGATRON_SLIM_CACHE`` if set, else ``~/.cache/megatron-slim``."""
    configured = os.environ.get(CACHE_ENV)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "megatron-slim"


@contextmanager
def exclusive_lock(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``lock_path`` (created if missing) for the block."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def build_once(entry: Path, build: Callable[[Path], None]) -> bool:
    """Make directory ``entry`` exist, filled by ``build(staging_dir)``; True if this call built it.

    ``build`` writes into an empty staging directory beside ``entry``, which is renamed to
    ``entry`` when ``build`` returns. If ``build`` raises, nothing is published.
    """
    if entry.is_dir():
        return False
    with exclusive_lock(entry.parent / f".{entry.name}.lock"):
        if entry.is_dir():
            return False
        # Under the lock, any staging directory for this entry belongs to a dead process.
        for stale in entry.parent.glob(f".{entry.name}.staging-*"):
            shutil.rmtree(stale, ignore_errors=True)
        staging = entry.parent / f".{entry.name}.staging-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        staging.mkdir()
        try:
            build(staging)
            os.rename(staging, entry)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return True


def file_manifest(folder: Path, skip: tuple[str, ...] = ()) -> dict[str, dict[str, Any]]:
    """Size and SHA-256 of every file in ``folder`` (not in sub-folders), for a cache entry's metadata."""
    return file_checksums(folder, skip)


def manifest_problem(folder: Path, manifest: Any) -> Optional[str]:
    """Why ``folder`` does not hold exactly what ``manifest`` recorded (None: it does)."""
    if not isinstance(manifest, dict) or not manifest:
        return "no file checksums in its metadata"
    bad = first_mismatch(folder, manifest)
    if bad is None:
        return None
    if bad.what == "missing":
        return f"{bad.name} is missing"
    if bad.what == "bytes":
        return f"{bad.name} has {bad.found} bytes, {bad.recorded} were written"
    return f"{bad.name} does not match the checksum written with it"


def rebuild(entry: Path, build: Callable[[Path], None]) -> None:
    """Replace a damaged entry: under its lock, move it aside and remove it, then build it again
    (a process that finds it rebuilt by another meanwhile keeps that one)."""
    with exclusive_lock(entry.parent / f".{entry.name}.lock"):
        if entry.is_dir():
            aside = entry.parent / f".{entry.name}.damaged-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            os.rename(entry, aside)
            shutil.rmtree(aside, ignore_errors=True)
    build_once(entry, build)
