"""Live migration of layers between pipeline ranks at an iteration boundary (DynMo).

``migrate(training, new_partition)`` moves every layer whose stage changes to its new pipeline rank
with its weights, gradient and AdamW state (``exp_avg``, ``exp_avg_sq``, ``step``; fp32 training
keeps no separate master weights), keeping layer order and global layer numbers, and leaves the
run training the new split: new chunks, the optimizer and scheduler rebuilt around them, the
gradient lists, CP attachments and vocabulary head renewed.

Order of work, so that a refused or failed migration leaves the run as it was:

1. every rank checks what it holds and all ranks vote (one ``all_gather_object``): any refusal, or
   ranks given different partitions, refuses everywhere before anything moves;
2. each rank builds its chunks for the new split and a fresh optimizer and scheduler;
3. leaving layers are sent, arriving ones received (P2P in the pipeline group, one message per layer);
4. the new chunks are filled, kept layers and the embedding / output ends copied from the old ones;
5. the new objects replace the old ones in ``training``.

The running state is only read before step 5. Whole chunks are rebuilt rather than layers spliced
into a module list because a chunk built for the new range is exactly what a run started at that
split holds (layer numbers, megatron's per-block bookkeeping, recompute groups): the migrated run
and a fresh one at the new split are the same program with the same state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_slim.plan.dynmo.partition import Partition
from megatron_slim.train.dynmo.layer_state import pack, packed_numel, state_problem, unpack


class MigrationError(RuntimeError):
    """A migration was refused on some rank before anything moved; the run is unchanged."""


@dataclass(frozen=True)
class MigrationReport:
    before: tuple[int, ...]
    after: tuple[int, ...]
    layers_sent: int
    layers_received: int
    numbers_sent: int  # fp32 numbers this rank sent
    released: bool = False  # consolidation freed this rank: its training ends


def migrate(training: Any, new_partition: Partition) -> MigrationReport:
    """Move this pipeline group's layers to ``new_partition`` (collective: every rank calls it with
    the same partition). ``training`` is the loop's per-rank state (``train.loop._RankTraining``).
    Fewer stages than ``parallel.pp`` consolidate onto fewer ranks (``consolidation``)."""
    if isinstance(new_partition, Partition) and new_partition.num_stages < training.recipe.parallel.pp:
        from megatron_slim.train.dynmo.consolidation import consolidate

        return consolidate(training, new_partition)
    old = current_partition(training.chunks, training.groups)
    problem, rebuilt = _local_problem(training, new_partition), None
    if not problem:
        try:
            rebuilt = _rebuild(training, new_partition)
        except Exception as exc:  # reported through the vote, so no rank moves anything
            problem = f"building the chunks for {list(new_partition.layers_per_stage)} failed: {exc!r}"
    vote(problem, new_partition)
    assert rebuilt is not None, "the vote refuses when a rank could not rebuild"
    chunks, optimizer, scheduler = rebuilt
    pp_rank = training.groups.pp_rank
    received, sent = _exchange(training, old, new_partition)
    _fill(training.chunks[0], training.optimizer, chunks[0], optimizer, received)
    scheduler.load_state_dict(training.scheduler.state_dict())
    for new_group, old_group in zip(optimizer.param_groups, training.optimizer.param_groups):
        new_group.update({k: v for k, v in old_group.items() if k != "params"})
    _swap(training, chunks, optimizer, scheduler, new_partition)
    return MigrationReport(
        old.layers_per_stage,
        new_partition.layers_per_stage,
        layers_sent=len(_leaving(old, new_partition, pp_rank)),
        layers_received=len(received),
        numbers_sent=sent,
    )


def _local_problem(training: Any, new: Any) -> str:
    recipe, chunks = training.recipe, training.chunks
    pp, num_layers = recipe.parallel.pp, recipe.model.num_layers
    if not isinstance(new, Partition):
        return f"new_partition={new!r}; allowed: a megatron_slim.plan.dynmo.Partition"
    if new.num_stages != pp or new.num_layers != num_layers:
        return (
            f"new_partition={list(new.layers_per_stage)} has {new.num_stages} stages of {new.num_layers} layers; "
            f"allowed: {pp} stages (parallel.pp) holding model.num_layers={num_layers}"
        )
    if getattr(chunks[0], "slim_build_kwargs", None) is None:
        return "the chunks were not built by megatron_slim.megatron.model.gpt.build_rank_chunks"
    return state_problem(list(chunks[0].parameters()), training.optimizer)


def current_partition(chunks: list, groups: Any) -> Partition:
    """The split the pipeline group trains now, read off every rank's chunk (collective in the
    pipeline group). Migration needs one chunk per rank (parallel.vpp=1)."""
    if len(chunks) != 1:
        raise MigrationError(f"this rank holds {len(chunks)} virtual chunks; allowed: parallel.vpp=1")
    mine = chunks[0].slim_chunk_info.layers
    spans = [mine]
    if groups.pp_size > 1:
        spans = [None] * groups.pp_size
        dist.all_gather_object(spans, mine, group=groups.pp)
    if any(a.stop != b.start for a, b in zip(spans, spans[1:])) or spans[0].start != 0:
        raise MigrationError(f"the pipeline ranks hold layers {spans}; allowed: consecutive ranges from layer 0")
    return Partition(tuple(len(s) for s in spans))


def vote(problem: str, new: Partition) -> None:
    """Raise ``MigrationError`` on every rank when any rank refuses or the ranks disagree."""
    mine = (problem, tuple(new.layers_per_stage) if isinstance(new, Partition) else repr(new))
    votes: list[Any] = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        votes = [None] * dist.get_world_size()
        dist.all_gather_object(votes, mine)
    refusals = [f"rank {r}: {p}" for r, (p, _) in enumerate(votes) if p]
    if refusals:
        raise MigrationError("migration refused, nothing moved: " + "; ".join(refusals))
    partitions = sorted({str(list(v[1])) for v in votes})
    if len(partitions) > 1:
        raise MigrationError(f"migration refused, nothing moved: ranks were given different partitions {partitions}")


def _rebuild(training: Any, new: Partition):
    from megatron_slim.megatron.model.gpt import build_rank_chunks
    from megatron_slim.megatron.model.optimizer import build_optimizer

    recipe, built = training.recipe, training.chunks[0].slim_build_kwargs
    chunks = build_rank_chunks(recipe.model, training.groups, layers_per_stage=new.layers_per_stage, **built)
    optimizer, scheduler = build_optimizer(chunks, recipe.train)
    return chunks, optimizer, scheduler


def _leaving(old: Partition, new: Partition, rank: int) -> list[int]:
    start, end = old.bounds()[rank]
    owner = new.stage_of_layer()
    return [g for g in range(start, end) if owner[g] != rank]


def layer_params(chunk, layer: int) -> list[torch.nn.Parameter]:
    """Parameters of global layer ``layer`` held by ``chunk``, in ``named_parameters()`` order."""
    module = chunk.decoder.layers[layer - chunk.slim_chunk_info.layers.start]
    assert module.layer_number == layer + 1, "layers keep their global numbers"
    return [p for _, p in module.named_parameters()]


def _exchange(training: Any, old: Partition, new: Partition) -> tuple[dict[int, torch.Tensor], int]:
    """Send the leaving layers' state, receive the arriving ones'; ``(received by layer, numbers sent)``."""
    groups, chunk = training.groups, training.chunks[0]
    rank = groups.pp_rank
    start, end = new.bounds()[rank]
    old_owner, new_owner = old.stage_of_layer(), new.stage_of_layer()
    arriving = [g for g in range(start, end) if old_owner[g] != rank]
    leaving = _leaving(old, new, rank)
    if not (arriving or leaving):
        return {}, 0
    ranks = dist.get_process_group_ranks(groups.pp)
    outgoing = [pack(layer_params(chunk, g), training.optimizer) for g in leaving]
    works: list[Any] = [
        dist.isend(buf, dst=ranks[new_owner[g]], group=groups.pp, tag=g) for g, buf in zip(leaving, outgoing)
    ]
    # the arriving layer's parameter shapes equal the leaving one's: every layer is built from one spec
    template = layer_params(chunk, chunk.slim_chunk_info.layers.start)
    received = {g: torch.empty(packed_numel(template)) for g in arriving}
    works += [dist.irecv(buf, src=ranks[old_owner[g]], group=groups.pp, tag=g) for g, buf in received.items()]
    for work in works:
        work.wait()
    return received, sum(buf.numel() for buf in outgoing)


def end_params(chunk) -> dict[str, torch.nn.Parameter]:
    """The chunk's parameters outside its decoder layers (embedding, final norm, output layer), by
    whole-model name."""
    from megatron_slim.megatron.model.weights import global_named_parameters

    return {n: p for n, p in global_named_parameters(chunk).items() if not n.startswith("decoder.layers.")}


def _fill(old_chunk, old_optimizer, new_chunk, new_optimizer, received: dict[int, torch.Tensor]) -> None:
    """The new chunk's state: arriving layers from ``received``, the rest copied from the old chunk."""
    for g in new_chunk.slim_chunk_info.layers:
        state = received[g] if g in received else pack(layer_params(old_chunk, g), old_optimizer)
        unpack(state, layer_params(new_chunk, g), new_optimizer)
    old_ends, new_ends = end_params(old_chunk), end_params(new_chunk)
    if set(old_ends) != set(new_ends):
        raise RuntimeError(f"the stage's end parameters changed: {sorted(old_ends)} -> {sorted(new_ends)}")
    for name, param in new_ends.items():
        unpack(pack([old_ends[name]], old_optimizer), [param], new_optimizer)


def _swap(training: Any, chunks: list, optimizer, scheduler, new: Partition) -> None:
    training.chunks, training.optimizer, training.scheduler = chunks, optimizer, scheduler
    training.__post_init__()  # parameter lists and the dynmo section's hooks (freezing re-applies next iteration)
    if training.cp_step is not None:
        training.cp_step.attach(chunks)
    if training.vocab_head is not None:
        from megatron_slim.megatron.model.vocab_head import build_vocab_head

        training.vocab_head = build_vocab_head(chunks, training.groups)
