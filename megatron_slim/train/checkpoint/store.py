"""Saving and loading one iteration with ``torch.distributed.checkpoint`` (collective: every rank
calls it).

A save writes into ``iter_N.partial``; once every rank is done, rank 0 adds ``recipe.json`` and
the checksum manifest, renames the folder to ``iter_N`` and only then rewrites ``latest``. A run
that dies at any point leaves the previous ``latest`` and its iteration as they were.

Besides the tensors (``naming``) a checkpoint holds the scheduler state, the reporting rank's
loss history and CP summaries (``report``), the parallel layout it was written with, and each
rank's RNG states (``rng/rank<r>``). RNG states are restored only under the same layout: under
another split rank ``r`` is another part of the model. No training step draws from them (the
model has no dropout; weights are initialised per parameter from the seed).
"""

from __future__ import annotations

import functools
import json
import random
import shutil
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.api import CheckpointException

from megatron_slim.train.checkpoint import layout, naming

_LAYOUT_KEYS = ("tp", "pp", "vpp", "cp", "dp")
# keys are flat already; unflattened, a dict value (scheduler, report, rng) is stored as one object
_SAVE_PLANNER = functools.partial(DefaultSavePlanner, flatten_state_dict=False)
_LOAD_PLANNER = functools.partial(DefaultLoadPlanner, flatten_state_dict=False, flatten_sharded_tensors=False)


def _layout(recipe: dict) -> dict:
    return {k: recipe["parallel"][k] for k in _LAYOUT_KEYS}


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


class CheckpointNotWritten(RuntimeError):
    """A save failed on some rank (a full disk, a quota); every rank raises it, naming the folder
    and the reason, and the previous checkpoint and ``latest`` are as they were."""


def save(
    directory, iteration: int, rank: int, chunks, optimizer, scheduler, recipe: dict, report: Optional[dict] = None
) -> None:
    """Save this rank's part of ``iteration``; ``report`` (losses, cp_iterations) comes from the
    reporting rank only. The iteration appears in one rename and ``latest`` names it last. Every
    rank returns, or every rank raises :class:`CheckpointNotWritten`: after each step the ranks
    agree on its outcome (the agreement is also the step's barrier), so none is left waiting."""
    partial, final = layout.partial_dir(directory, iteration), layout.iteration_dir(directory, iteration)

    def prepare() -> None:
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)

    def write() -> None:
        state = dict(
            naming.training_state(chunks, optimizer),
            scheduler=scheduler.state_dict(),
            layout=_layout(recipe),
            **{f"rng/rank{rank}": _rng_state()},
        )
        if report is not None:
            state["report"] = report
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(partial)), planner=_SAVE_PLANNER())

    def publish() -> None:
        if rank != 0:
            return
        layout.write_atomic(partial / layout.RECIPE, json.dumps(recipe, indent=1))
        layout.write_manifest(partial, iteration)
        if final.exists():  # saved before, then resumed from an older iteration
            stale = final.with_name(final.name + ".stale")
            shutil.rmtree(stale, ignore_errors=True)
            final.rename(stale)
            partial.rename(final)
            shutil.rmtree(stale)
        else:
            partial.rename(final)
        layout.write_atomic(Path(directory) / layout.LATEST, f"{iteration}\n")

    for step in (prepare, write, publish):
        failure = None
        try:
            step()
        except (OSError, CheckpointException) as exc:
            failure = _reason(exc, partial)
        reasons: list = [None] * dist.get_world_size()
        dist.all_gather_object(reasons, failure)
        if any(reasons):
            if rank == 0:
                shutil.rmtree(partial, ignore_errors=True)
            raise _not_written(directory, partial, iteration, reasons)


def _not_written(directory, partial: Path, iteration: int, reasons: list) -> CheckpointNotWritten:
    latest, _ = layout.read_latest(directory)
    kept = (
        f"the checkpoint of iteration {latest} and `latest` are unchanged"
        if latest
        else "no checkpoint was saved before"
    )
    said = "; ".join(sorted({r for r in reasons if r}))
    return CheckpointNotWritten(
        f"iteration {iteration}: its checkpoint could not be written to {partial} ({said}); {kept}"
    )


# Below this much free space a failed write is reported as a full disk: torch's C++ stream writer
# turns a short write into "[enforce fail at inline_container.cc] unexpected pos ..." with no errno.
LOW_SPACE_BYTES = 1 << 20


def _reason(exc: BaseException, folder: Path) -> str:
    """An OSError's own words and file (dcp wraps them per rank); else, when ``folder``'s disk is
    (nearly) full, that; else the first line of the innermost failure."""
    seen = [exc]
    while len(seen) < 10 and (nested := seen[-1].__cause__ or seen[-1].__context__) is not None:
        seen.append(nested)
    failures = getattr(exc, "failures", None) or {}  # CheckpointException: rank -> (exception, traceback)
    seen += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    for cause in seen:
        if isinstance(cause, OSError):
            where = f": {cause.filename}" if cause.filename else ""
            return f"{cause.strerror or cause}{where}"
    lines = str(seen[-1]).strip().splitlines()
    said = lines[0] if lines else type(seen[-1]).__name__
    try:
        free = shutil.disk_usage(folder if folder.exists() else folder.parent).free
    except OSError:
        return said
    if free < LOW_SPACE_BYTES:
        return f"No space left on device: {free:,} bytes free ({said})"
    return said


class IncompatibleCheckpoint(RuntimeError):
    """The checkpoint lacks state this rank needs (checked before any work by ``resume``)."""


def load(directory, iteration: int, rank: int, chunks, optimizer, scheduler, recipe: dict) -> dict:
    """Load ``iteration`` into this rank's chunks, optimizer and scheduler; returns the saved
    ``report`` (empty when the reporting rank saved none)."""
    folder = str(layout.iteration_dir(directory, iteration))
    reader = dcp.FileSystemReader(folder)
    saved = reader.read_metadata().state_dict_metadata
    wanted, missing = naming.placeholders(chunks, saved)
    if missing:
        raise IncompatibleCheckpoint(
            f"{folder} has no weights for {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}"
        )
    objects = [key for key in ("scheduler", "layout", "report", f"rng/rank{rank}") if key in saved]
    state: dict[str, Any] = dict(wanted, **dict.fromkeys(objects))
    # fills the tensors in place and replaces the objects' values
    dcp.load(state, storage_reader=reader, planner=_LOAD_PLANNER())
    naming.apply(chunks, optimizer, wanted)
    scheduler.load_state_dict(state["scheduler"])
    rng = state.get(f"rng/rank{rank}")
    if rng is not None and state["layout"] == _layout(recipe):
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
    return state.get("report") or {}
