"""Per-microbatch sequence lengths handed from the first pipeline stage to the others.

Under Megatron-LM's ``pretrain_gpt.py`` only the first and last pipeline stages read batches
(``get_batch`` returns ``None`` elsewhere, and no dataset is built on the middle ranks), yet a
middle stage needs each microbatch's document lengths: the slice attention keeps documents apart
(``--slimpipe-packing``) and a CP engine plans each pack from them (``--cp-engine``). The middle
ranks hold no copy of the data source, so they cannot re-derive the lengths; the first stage reads
every microbatch of the call up front, and one broadcast over the pipeline group hands out the
lengths. That costs two small int64 broadcasts per schedule call (one for the size, one for the
words) and holds the call's token batches a little earlier than the schedule would read them.

Tensor parallelism has the same gap one level down: on a stage that reads batches only TP rank 0
gets a data iterator, and Megatron's TP batch broadcast (``get_batch_on_this_tp_rank``) carries
tensors only, so the window's ``document_lengths`` would stay on TP rank 0. The same collective
over the stage's TP group hands them to the other TP ranks (``megatron/slimpipe/stage.py``). The
CP engines need the lengths on every stage and TP rank: ``first_rank_lengths`` (and
``share_first_stage_lengths``, which also reads them) hands stage 0's TP rank 0 lengths down the
pipeline among TP rank 0s, then across each stage's TP ranks (``megatron/cp/hooks.py``,
``megatron/slimpipe/engine_slices.py``).

Wire form (``encode_lengths``): ``[count, n_0, l_0_0 .. l_0_{n_0-1}, n_1, ...]``; ``n = 0`` stands
for a microbatch without lengths (a plain window: one causal sequence).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

MicrobatchLengths = list[Optional[tuple[int, ...]]]


def encode_lengths(per_microbatch: Sequence[Optional[Sequence[int]]]) -> list[int]:
    """The wire words of each microbatch's lengths (``None``: no lengths)."""
    words = [len(per_microbatch)]
    for lengths in per_microbatch:
        values = [int(n) for n in lengths] if lengths is not None else []
        if any(n <= 0 for n in values) or (lengths is not None and not values):
            raise ValueError(f"sequence lengths {tuple(values)}: allowed: one or more positive integers, or None")
        words.append(len(values))
        words.extend(values)
    return words


def decode_lengths(words: Sequence[int]) -> MicrobatchLengths:
    """Inverse of ``encode_lengths``; raises on a malformed word list."""
    if not words:
        raise ValueError("microbatch lengths: empty word list; allowed: [count, n_0, lengths_0 ...]")
    count, at, out = int(words[0]), 1, []
    for microbatch in range(count):
        if at >= len(words):
            raise ValueError(f"microbatch lengths: word list ends before microbatch {microbatch} of {count}")
        n = int(words[at])
        values = tuple(int(x) for x in words[at + 1 : at + 1 + n])
        if len(values) != n:
            raise ValueError(f"microbatch lengths: microbatch {microbatch} announces {n} lengths, {len(values)} follow")
        out.append(values if n else None)
        at += 1 + n
    if at != len(words):
        raise ValueError(f"microbatch lengths: {len(words) - at} words after the last of {count} microbatches")
    return out


def broadcast_lengths(
    per_microbatch: Optional[MicrobatchLengths], group: Any, device: torch.device | str = "cpu"
) -> MicrobatchLengths:
    """Collective over the pipeline ``group``: every rank gets the lengths its first rank
    (pipeline stage 0) passes; the other ranks pass ``None``."""
    source = dist.get_process_group_ranks(group)[0]
    is_source = dist.get_rank() == source
    if is_source and per_microbatch is None:
        raise ValueError("broadcast_lengths: the first pipeline stage must pass its microbatches' lengths")
    words = encode_lengths(per_microbatch) if is_source and per_microbatch is not None else []
    size = torch.tensor([len(words)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=source, group=group)
    payload = (
        torch.tensor(words, dtype=torch.int64, device=device)
        if is_source
        else torch.empty(int(size.item()), dtype=torch.int64, device=device)
    )
    dist.broadcast(payload, src=source, group=group)
    return decode_lengths(payload.tolist())


def read_microbatch_lengths(
    data_iterator: Optional[Iterator], num_microbatches: int, lengths_of: Callable[[Any], Optional[tuple[int, ...]]]
) -> tuple[Iterator, MicrobatchLengths]:
    """Local: read the call's ``num_microbatches`` batches up front and measure each with
    ``lengths_of``; returns an iterator replaying them in order, and the lengths."""
    if data_iterator is None:
        raise ValueError(
            "the rank that hands the microbatches' lengths to the others has no data iterator; allowed: "
            "the first rank of the group reads the batches (TP rank 0 of the first pipeline stage)"
        )
    batches = [next(data_iterator) for _ in range(num_microbatches)]
    return iter(batches), [lengths_of(b) for b in batches]


def share_microbatch_lengths(
    data_iterator: Optional[Iterator],
    num_microbatches: int,
    lengths_of: Callable[[Any], Optional[tuple[int, ...]]],
    group: Any,
    device: torch.device | str = "cpu",
) -> tuple[Optional[Iterator], MicrobatchLengths]:
    """Collective over ``group`` (the pipeline group, or a stage's tensor-parallel group, whose first
    rank, TP rank 0, is the one Megatron gives a data iterator). The group's first rank reads the
    call's ``num_microbatches`` batches from ``data_iterator`` and measures each with ``lengths_of``
    (``read_microbatch_lengths``); every rank of the group gets those lengths. Returns the iterator
    to run the schedule on (the first rank's replays what it read, in order; the others' is theirs
    unchanged) and the lengths."""
    first = dist.get_rank() == dist.get_process_group_ranks(group)[0]
    mine: Optional[MicrobatchLengths] = None
    if first:
        data_iterator, mine = read_microbatch_lengths(data_iterator, num_microbatches, lengths_of)
    return data_iterator, _counted(broadcast_lengths(mine, group, device), num_microbatches)


def _counted(shared: MicrobatchLengths, num_microbatches: int) -> MicrobatchLengths:
    if len(shared) != num_microbatches:
        raise ValueError(
            f"the group's first rank sent lengths of {len(shared)} microbatches; expected {num_microbatches}"
        )
    return shared


def first_rank_lengths(
    own: Optional[MicrobatchLengths], pipeline_group: Any, tensor_group: Any, device: torch.device | str = "cpu"
) -> MicrobatchLengths:
    """Collective over a pipeline x tensor-parallel grid: every rank gets the lengths that pipeline
    stage 0's tensor-parallel rank 0 passes (``own``; the only rank there that reads batches). One
    broadcast down the pipeline among TP rank 0s, then one across each stage's TP ranks; the other
    ranks' ``own`` is ignored."""
    shared = own
    if tensor_group.rank() == 0 and pipeline_group.size() > 1:
        if pipeline_group.rank() == 0 and own is None:
            raise ValueError(
                "the first pipeline stage's tensor-parallel rank 0 read no batches (no data iterator), so it "
                "cannot hand the microbatches' lengths to the other ranks; allowed: a data iterator there"
            )
        shared = broadcast_lengths(own if pipeline_group.rank() == 0 else None, pipeline_group, device)
    if tensor_group.size() > 1:
        shared = broadcast_lengths(shared if tensor_group.rank() == 0 else None, tensor_group, device)
    if shared is None:
        raise ValueError("first_rank_lengths: a single rank must pass its own lengths")
    return shared


def share_first_stage_lengths(
    data_iterator: Optional[Iterator],
    num_microbatches: int,
    lengths_of: Callable[[Any], Optional[tuple[int, ...]]],
    pipeline_group: Any,
    tensor_group: Any,
    device: torch.device | str = "cpu",
) -> tuple[Optional[Iterator], MicrobatchLengths]:
    """Collective over a pipeline x tensor-parallel grid: pipeline stage 0's TP rank 0 (the one rank
    there that Megatron gives a data iterator) reads the call's ``num_microbatches`` batches up front
    and measures each with ``lengths_of`` (``read_microbatch_lengths``); every rank of the grid gets
    those lengths (``first_rank_lengths``). Returns the iterator to run the schedule on (that rank's
    replays what it read, in order; the others' is theirs unchanged) and the lengths."""
    own: Optional[MicrobatchLengths] = None
    if pipeline_group.rank() == 0 and tensor_group.rank() == 0:
        data_iterator, own = read_microbatch_lengths(data_iterator, num_microbatches, lengths_of)
    return data_iterator, _counted(first_rank_lengths(own, pipeline_group, tensor_group, device), num_microbatches)
