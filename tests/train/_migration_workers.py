"""Rank functions for the migration tests: ``train_rank`` with ``migrate`` wrapped so each move
records per-parameter checksums of the whole pipeline before and after it (after a consolidation:
over the ranks that stay), and first tries a partition every rank must refuse (nothing may change)."""

import hashlib

import torch
import torch.distributed as dist


def _digest(tensor) -> str:
    return "none" if tensor is None else hashlib.sha256(tensor.detach().contiguous().numpy().tobytes()).hexdigest()


def checksums(training) -> dict:
    """``{whole-model name: sorted digests of (weight, grad, step, exp_avg, exp_avg_sq)}`` over all ranks."""
    from megatron_slim.megatron.model.weights import global_named_parameters

    mine = {}
    for chunk in training.chunks:
        for name, p in global_named_parameters(chunk).items():
            state = training.optimizer.state.get(p, {})
            fields = [_digest(p), _digest(p.grad)] + [_digest(state.get(k)) for k in ("step", "exp_avg", "exp_avg_sq")]
            mine[name] = tuple(fields)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    merged: dict = {}
    for part in everyone:
        for name, fields in part.items():
            merged.setdefault(name, set()).add(fields)
    return {name: sorted(v) for name, v in merged.items()}


def train_migrating(rank, world_size, recipe_data, prepared, options):
    import megatron_slim.train.dynmo.migration as migration
    from megatron_slim.plan.dynmo.partition import Partition
    from megatron_slim.train.loop import train_rank

    original, records = migration.migrate, []

    def recorded(training, partition):
        before = checksums(training)
        refused = ""
        try:  # pp stages of one layer each: not this model's layer count, refused on every rank
            original(training, Partition((1,) * training.recipe.parallel.pp))
        except migration.MigrationError as exc:
            refused = str(exc)
        assert checksums(training) == before
        moved = original(training, partition)
        record = dict(refused=refused, moved=moved, names=len(before))
        if not moved.released:  # a released rank has left the process group
            record.update(
                same=checksums(training) == before, layers=[list(c.slim_chunk_info.layers) for c in training.chunks]
            )
        records.append(record)
        return moved

    migration.migrate = recorded
    torch.set_num_threads(1)
    report = train_rank(rank, world_size, recipe_data, prepared, options)
    return report, records
