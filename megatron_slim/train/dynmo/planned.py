"""Migrations named ahead of time (``TrainOptions.migrations``): the hook the training loop calls
after every iteration. A DynMo trigger that decides from profiles calls ``migration.migrate`` the
same way."""

from __future__ import annotations

from typing import Any


def migrate_if_planned(training: Any, number: int) -> bool:
    """Move layers to the split ``options.migrations`` names for iteration ``number``, if any;
    False when a consolidation released this rank (its training ends)."""
    planned = dict(training.options.migrations).get(number)
    if planned is None:
        return True
    from megatron_slim.plan.dynmo.partition import Partition
    from megatron_slim.train.dynmo.migration import migrate  # looked up now: tests wrap it

    moved = migrate(training, Partition(tuple(planned)))
    if training.reporter and not training.options.quiet and not moved.released:
        print(
            f"iter {number:4d}: layers per stage {list(moved.before)} -> {list(moved.after)} (dynmo migration)",
            flush=True,
        )
    return not moved.released
