"""Consolidation (DynMo): continue training on fewer pipeline ranks; the freed ranks leave cleanly.

``migrate(training, partition)`` comes here when ``partition`` has fewer stages (K) than the run
(P). Pipeline ranks ``0 .. K-1`` stay, stage ``s`` of the new split on rank ``s``; ranks
``K .. P-1`` are released (``plan.dynmo.consolidate.released_ranks``). In order:

1. every rank checks what it holds and all vote (``migration.vote``): a refusal anywhere refuses
   everywhere before anything moves;
2. over the old pipeline group each layer's state goes to its new rank, and the last stage's end
   (final norm, output layer, the loss history it reports) from rank P-1 to rank K-1; a kept rank
   also packs what it keeps, because
3. the process groups are rebuilt: megatron's ``parallel_state`` is torn down and the default
   group destroyed on every rank; the kept ranks join a new K-rank world through the launcher's
   store (``MASTER_ADDR``/``MASTER_PORT``, a fresh key prefix) and rebuild the parallel groups;
   released ranks return with ``released=True`` and their training loop ends;
4. kept ranks build chunks, optimizer and scheduler for the new split, fill and swap them in.

Limits, refused by name: tp = cp = dp = 1, vpp = 1, no vocabulary-parallel head. Past step 3
there is no way back; step 1 checks all that can be checked before it.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from megatron_slim.plan.dynmo.consolidate import released_ranks
from megatron_slim.plan.dynmo.partition import Partition
from megatron_slim.train.dynmo.layer_state import pack, state_problem, unpack
from megatron_slim.train.dynmo.migration import MigrationReport, current_partition, end_params, layer_params, vote
from megatron_slim.train.dynmo.payloads import exchange

LOSSES = ("report", "losses")


def consolidate(training: Any, new_partition: Partition) -> MigrationReport:
    """Move the layers onto ``new_partition.num_stages`` ranks and continue there (collective)."""
    old = current_partition(training.chunks, training.groups)
    vote(_problem(training, old, new_partition), new_partition)
    kept = new_partition.num_stages
    outgoing, local, sources = _route(training, old, new_partition)
    received = exchange(outgoing, sources, training.groups.pp)
    for payload in received.values():  # a kept rank's own copy wins (the tied embedding's two copies agree)
        for key, value in payload.items():
            local.setdefault(key, value)
    released = _rejoin(training, kept, old.num_stages)
    report = MigrationReport(
        old.layers_per_stage,
        new_partition.layers_per_stage,
        layers_sent=sum(len([k for k in p if k[0] == "layer"]) for p in outgoing.values()),
        layers_received=sum(len([k for k in p if k[0] == "layer"]) for p in received.values()),
        numbers_sent=sum(t.numel() for p in outgoing.values() for k, t in p.items() if k != LOSSES),
        released=released,
    )
    if released:
        training.report.losses = []  # handed to the new last stage, which reports from now on
        return report
    _restart(training, new_partition, local)
    return report


def _problem(training: Any, old: Partition, new: Any) -> str:
    p, num_layers = training.recipe.parallel, training.recipe.model.num_layers
    if not isinstance(new, Partition) or not 1 <= new.num_stages < old.num_stages or new.num_layers != num_layers:
        return f"new_partition={new!r}; allowed: a Partition of {num_layers} layers over 1..{old.num_stages - 1} stages"
    for name in ("tp", "cp", "dp"):
        if getattr(p, name) != 1:
            return f"parallel.{name}={getattr(p, name)}; allowed for consolidation: 1"
    if training.vocab_head is not None:
        return "schedule.vocab_parallel=true; allowed for consolidation: false"
    if dist.get_rank() != training.groups.pp_rank or not all(k in os.environ for k in ("MASTER_ADDR", "MASTER_PORT")):
        return "consolidation needs global rank == pipeline rank and MASTER_ADDR/MASTER_PORT (the launcher's store)"
    return state_problem(list(training.chunks[0].parameters()), training.optimizer)


def _route(training: Any, old: Partition, new: Partition):
    """``(outgoing {dst: {key: packed}}, kept here {key: packed}, sources)`` for this pipeline rank."""
    me, chunk, optimizer = training.groups.pp_rank, training.chunks[0], training.optimizer
    old_owner, new_owner = old.stage_of_layer(), new.stage_of_layer()
    last_now, last_after = old.num_stages - 1, new.num_stages - 1
    outgoing: dict[int, dict] = {}
    local: dict = {}
    for g in chunk.slim_chunk_info.layers:
        target = local if new_owner[g] == me else outgoing.setdefault(new_owner[g], {})
        target[("layer", g)] = pack(layer_params(chunk, g), optimizer)
    ends = {("end", name): pack([param], optimizer) for name, param in end_params(chunk).items()}
    if me == last_now:
        outgoing.setdefault(last_after, {}).update(ends)
        outgoing[last_after][LOSSES] = [list(x) for x in training.report.losses]
    if me not in released_ranks(old.num_stages, new.num_stages):
        local.update(ends)
    sources: set[int] = set()
    if me < new.num_stages:
        start, end = new.bounds()[me]
        sources = {old_owner[g] for g in range(start, end)} - {me}
        if me == last_after:
            sources.add(last_now)
    return outgoing, local, sources


def _rejoin(training: Any, kept: int, was: int) -> bool:
    """Tear the old groups down everywhere; kept ranks form a ``kept``-rank world. True if released."""
    from megatron_slim.megatron.model.parallel import teardown

    rank = dist.get_rank()
    teardown()
    dist.destroy_process_group()
    if rank >= kept:
        return True
    timeout = timedelta(minutes=10)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    prefixed = dist.PrefixStore(f"megatron-slim/consolidate/{was}-to-{kept}", store)
    dist.init_process_group("gloo", store=prefixed, rank=rank, world_size=kept, timeout=timeout)
    os.environ["WORLD_SIZE"] = str(kept)
    return False


def _restart(training: Any, new: Partition, state: dict) -> None:
    """Kept rank: groups, chunks, optimizer and schedule for the new split, filled from ``state``."""
    from megatron_slim.megatron.model.gpt import build_rank_chunks
    from megatron_slim.megatron.model.optimizer import build_optimizer
    from megatron_slim.megatron.model.parallel import init_model_parallel
    from megatron_slim.megatron.slimpipe.schedule import make_forward_backward_func
    from megatron_slim.plan.recipe import recipe_from_dict
    from megatron_slim.train.loop import pipeline_settings
    from megatron_slim.train.metrics import open_metrics
    from megatron_slim.train.profiler import IterationProfiler

    data = training.recipe_data
    data = dict(data, parallel=dict(data["parallel"], pp=new.num_stages, layers_per_stage=list(new.layers_per_stage)))
    recipe, built = recipe_from_dict(data), training.chunks[0].slim_build_kwargs
    groups = init_model_parallel(tp=1, pp=new.num_stages, cp=1, vpp=1, dp=1, seed=recipe.train.seed)
    chunks = build_rank_chunks(recipe.model, groups, layers_per_stage=new.layers_per_stage, **built)
    optimizer, scheduler = build_optimizer(chunks, recipe.train)
    _fill(chunks[0], optimizer, state)
    scheduler.load_state_dict(training.scheduler.state_dict())
    for new_group, old_group in zip(optimizer.param_groups, training.optimizer.param_groups):
        new_group.update({k: v for k, v in old_group.items() if k != "params"})
    was_reporter = training.reporter
    training.recipe, training.recipe_data, training.groups = recipe, data, groups
    training.chunks, training.optimizer, training.scheduler = chunks, optimizer, scheduler
    training.forward_backward = make_forward_backward_func(pipeline_settings(recipe, training.options.measure_memory))
    training.__post_init__()  # last stage, reporter, parameter and gradient lists
    training.report.pp_rank = groups.pp_rank
    if LOSSES in state:
        training.report.losses = [tuple(x) for x in state[LOSSES]]
    training.profiler = IterationProfiler(training.options.profile, training.rank, recipe, groups)
    if training.reporter and not was_reporter:
        training.metrics = open_metrics(training.options.metrics, recipe, True)


def _fill(chunk, optimizer, state: dict) -> None:
    for g in chunk.slim_chunk_info.layers:
        unpack(state[("layer", g)], layer_params(chunk, g), optimizer)
    for name, param in end_params(chunk).items():
        unpack(state[("end", name)], [param], optimizer)
