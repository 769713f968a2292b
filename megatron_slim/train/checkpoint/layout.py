"""Where a checkpoint's files lie, their checksum manifest, and which iteration a run resumes from.

::

    <dir>/iter_0000012/            one complete iteration: torch.distributed.checkpoint files
                                   (.metadata, __<rank>_<n>.distcp), recipe.json, manifest.json
    <dir>/iter_0000012.partial/    an iteration being written (ignored; the next save replaces it)
    <dir>/latest                   the newest complete iteration, written last (by rename)

``manifest.json`` lists every other file of its iteration with its size and sha256; it is written
after all ranks finished saving, before the folder is renamed into place. An iteration is intact
when its manifest reads back and every file it lists has that size and hash. Pure Python: the
command checks a directory before it starts any rank.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from megatron_slim.plan.checksums import file_checksums, first_mismatch
from megatron_slim.plan.files import replace_atomically

FORMAT = "megatron-slim-dcp/1"
MANIFEST = "manifest.json"
RECIPE = "recipe.json"
LATEST = "latest"
_ITERATION_DIR = re.compile(r"^iter_(\d{7})$")


class DamagedIteration(Exception):
    """One iteration folder cannot be used; the message says why."""


def iteration_dir(directory: str | Path, iteration: int) -> Path:
    return Path(directory) / f"iter_{iteration:07d}"


def partial_dir(directory: str | Path, iteration: int) -> Path:
    return Path(directory) / f"iter_{iteration:07d}.partial"


def write_atomic(path: Path, text: str) -> None:
    """``path`` holds either its old content or all of ``text``, never a part; an ``OSError`` (a full
    disk) propagates, for the save's agreement between ranks."""
    replace_atomically(path, text)


def write_manifest(folder: Path, iteration: int) -> None:
    """Checksum every file in ``folder`` (written by all ranks) into its manifest."""
    files = file_checksums(folder, skip=(MANIFEST,))
    write_atomic(folder / MANIFEST, json.dumps({"format": FORMAT, "iteration": iteration, "files": files}, indent=1))


def _read_manifest(folder: Path) -> dict:
    path = folder / MANIFEST
    if not path.is_file():
        raise DamagedIteration(
            f"{folder.name} has no {MANIFEST} (an unfinished save, or not a megatron-slim {FORMAT} checkpoint)"
        )
    try:
        manifest = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise DamagedIteration(f"{folder.name}/{MANIFEST} is not valid JSON") from None
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != FORMAT
        or not isinstance(manifest.get("files"), dict)
    ):
        raise DamagedIteration(f"{folder.name}/{MANIFEST} is not a {FORMAT} manifest")
    return manifest


def verify(directory: str | Path, iteration: int) -> dict:
    """The recipe saved with ``iteration``, after checking every file against the manifest;
    raises :class:`DamagedIteration` naming the first problem."""
    folder = iteration_dir(directory, iteration)
    if not folder.is_dir():
        raise DamagedIteration(f"{folder.name} is missing")
    manifest = _read_manifest(folder)
    if manifest.get("iteration") != iteration:
        raise DamagedIteration(f"{folder.name}/{MANIFEST} describes iteration {manifest.get('iteration')!r}")
    if RECIPE not in manifest["files"]:
        raise DamagedIteration(f"{folder.name}/{MANIFEST} lists no {RECIPE}")
    bad = first_mismatch(folder, manifest["files"])
    if bad is not None and bad.what == "missing":
        raise DamagedIteration(f"{folder.name}/{bad.name} is missing")
    if bad is not None and bad.what == "bytes":
        raise DamagedIteration(
            f"{folder.name}/{bad.name} has {bad.found} bytes, the manifest says {bad.recorded} "
            "(truncated or overwritten)"
        )
    if bad is not None:
        raise DamagedIteration(f"{folder.name}/{bad.name} does not match its sha256 in the manifest (corrupt)")
    try:
        recipe = json.loads((folder / RECIPE).read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        recipe = None
    if not isinstance(recipe, dict) or not isinstance(recipe.get("train"), dict):
        raise DamagedIteration(f"{folder.name}/{RECIPE} is not a megatron-slim recipe")
    return recipe


def saved_iterations(directory: str | Path) -> list[int]:
    """Iterations with a folder in ``directory``, newest first."""
    found = (_ITERATION_DIR.match(p.name) for p in Path(directory).iterdir() if p.is_dir())
    return sorted((int(m.group(1)) for m in found if m), reverse=True)


def read_latest(directory: str | Path) -> tuple[Optional[int], str]:
    """``(iteration, problem)``: the iteration ``latest`` names, or None and why not ("" when
    there is no ``latest`` file)."""
    marker = Path(directory) / LATEST
    if not marker.exists():
        return None, ""
    try:
        text = marker.read_bytes().decode("utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        return None, f"{LATEST} cannot be read ({getattr(exc, 'strerror', None) or exc})"
    if not text.isdigit():
        return None, f"{LATEST} holds {text[:40]!r}, not an iteration number"
    return int(text), ""


@dataclass
class Choice:
    """The iteration to resume from (None: nothing saved) with its recipe, and why newer ones
    were passed over."""

    iteration: Optional[int] = None
    recipe: Optional[dict] = None
    skipped: list[str] = field(default_factory=list)


def choose_iteration(directory: str | Path) -> Choice:
    """The iteration ``latest`` names if intact, else the newest intact one before it (all saved
    iterations when ``latest`` is missing or unreadable). ``skipped`` explains each one passed
    over; an empty ``Choice`` with reasons in ``skipped`` means none is intact."""
    latest, problem = read_latest(directory)
    iterations = saved_iterations(directory)
    choice = Choice(skipped=[problem] if problem else [])
    if latest is not None:
        iterations = [i for i in iterations if i < latest]
        candidates = [latest, *iterations]
    else:
        candidates = iterations
    for iteration in candidates:
        try:
            choice.recipe = verify(directory, iteration)
        except DamagedIteration as exc:
            choice.skipped.append(f"iteration {iteration}: {exc}")
            continue
        choice.iteration = iteration
        break
    return choice
