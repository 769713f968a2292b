"""Checkpoints of a ``megatron-slim train`` run: one file per rank, written atomically.

Layout: ``<dir>/iter_0000012/rank_003.pt`` and ``<dir>/latest`` (the last complete iteration,
written by rank 0 only after every rank has saved, via rename). A run that dies mid-save leaves
the previous ``latest`` in place. A checkpoint records the recipe it came from; resuming with a
recipe that changes anything but the iteration count or save interval is refused.
"""
from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

RESUMABLE_KEYS = {"iters", "save_interval", "log_interval"}


def _comparable(recipe: dict) -> dict:
    out = {k: v for k, v in recipe.items() if k not in ("name", "description")}
    out["train"] = {k: v for k, v in recipe["train"].items() if k not in RESUMABLE_KEYS}
    return out


def latest_iteration(directory: str | Path) -> Optional[int]:
    marker = Path(directory) / "latest"
    if not marker.is_file():
        return None
    return int(marker.read_text().strip())


def _write_atomic(path: Path, write) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    write(tmp)
    os.replace(tmp, path)


def save(directory: str | Path, iteration: int, rank: int, state: dict, recipe: dict) -> None:
    folder = Path(directory) / f"iter_{iteration:07d}"
    folder.mkdir(parents=True, exist_ok=True)
    payload = dict(state, iteration=iteration, recipe=recipe,
                   rng={"torch": torch.get_rng_state(), "python": random.getstate()})
    _write_atomic(folder / f"rank_{rank:03d}.pt", lambda p: torch.save(payload, p))
    dist.barrier()
    if rank == 0:
        _write_atomic(Path(directory) / "recipe.json", lambda p: p.write_text(json.dumps(recipe, indent=1)))
        _write_atomic(Path(directory) / "latest", lambda p: p.write_text(f"{iteration}\n"))
    dist.barrier()


def check_resumable(directory: str | Path, recipe: dict) -> Optional[int]:
    """The iteration a run in ``directory`` would resume from (None: nothing to resume); raises
    ``ConfigError`` before any work when the checkpoint came from a different recipe."""
    from megatron_slim.plan.schema import ConfigError

    found = latest_iteration(directory)
    if found is None:
        return None
    saved = json.loads((Path(directory) / "recipe.json").read_text())
    if _comparable(saved) != _comparable(recipe):
        diff = sorted(f"{section}.{key}" for section in recipe if isinstance(recipe[section], dict)
                      for key in recipe[section] if saved.get(section, {}).get(key) != recipe[section][key]
                      and not (section == "train" and key in RESUMABLE_KEYS))
        raise ConfigError(f"--checkpoint-dir {directory}: its checkpoint (iteration {found}) was written by a "
                          f"different recipe (differs in: {', '.join(diff) or 'name-level fields'}); resume with "
                          "the same recipe (only train.iters, train.save_interval, train.log_interval may change), "
                          "use another directory, or pass --no-resume")
    return found


def load(directory: str | Path, iteration: int, rank: int, recipe: dict) -> dict:
    path = Path(directory) / f"iter_{iteration:07d}" / f"rank_{rank:03d}.pt"
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} is missing (was it written with another world size?)")
    payload = torch.load(path, weights_only=False)
    if _comparable(payload["recipe"]) != _comparable(recipe):
        raise ValueError(f"--checkpoint-dir {directory}: the checkpoint was written by a different recipe; "
                         "resume with the same recipe (only train.iters, train.save_interval and "
                         "train.log_interval may change) or pass --no-resume")
    torch.set_rng_state(payload["rng"]["torch"])
    random.setstate(payload["rng"]["python"])
    return payload
