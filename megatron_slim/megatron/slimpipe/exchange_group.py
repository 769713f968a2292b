"""The process group context-exchange messages travel on, beside the pipeline group's activations.

Gloo matches a point-to-point message by tag, so the exchange's own tag range keeps its messages
apart from the activations on the pipeline group itself. NCCL ignores tags and matches the messages
between two ranks in posting order (as gloo does under ``runtime/nccl_rules``); activation receives
posted ahead of their action would then take an exchange message's place. So on any other backend
(and on gloo under that checker) the exchange gets a group of its own over the same ranks (its own
communicators): there both ends of a pair post in one order (the sender
ships, then receives; the peer receives, then replies, layer by layer), and the pairs between two
ranks run in the schedule's order on both.

Making a group is collective over every rank of the job (NCCL splits the new communicator off the
default one, and a split needs all its ranks), so every rank makes every pipeline group's exchange
group, in one order: in the first training call that runs exchange, which every rank makes, since
all pipelines run one kind of schedule from the same flags.

Under context parallelism a taker stage's CP ranks compute served blocks together, by collectives
from a server thread (``runtime/pipeline/exchange_cp_server.py``) while the main thread runs its own
attention's CP collectives; collectives match by order, so the server's get a second group over
the same CP ranks (``exchange_cp_group``, on every backend, gloo included), made the same way.
"""

from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist

from megatron_slim.runtime.nccl_rules import tags_keep_messages_apart

_GROUPS: dict[tuple[str, str, tuple[int, ...]], Any] = {}


def exchange_group(pipeline_group: Any, separate: Optional[bool] = None) -> Any:
    """The group for ``pipeline_group``'s exchange messages: itself under gloo, else (or with
    ``separate``) a group of its own over the same ranks, made once per process."""
    if not (not tags_keep_messages_apart(pipeline_group) if separate is None else separate):
        return pipeline_group
    return _own_group("pipeline", pipeline_group)


def vocab_group(pipeline_group: Any) -> Any:
    """The group for the vocabulary exchanges of ``schedule.vocab_parallel`` (lookups, logits, their
    gradients, the weights' refresh): for the same reason as ``exchange_group``, one of its own
    where tags do not keep them apart from the activations (separate from the context exchange's:
    the two are posted in no common order)."""
    if tags_keep_messages_apart(pipeline_group):
        return pipeline_group
    return _own_group("vocab", pipeline_group)


def exchange_cp_group(cp_group: Any) -> Any:
    """A second group over ``cp_group``'s ranks, for the collectives of served blocks; made once per process."""
    return _own_group("cp", cp_group)


def _own_group(kind: str, like: Any) -> Any:
    backend, ranks = str(dist.get_backend(like)), tuple(dist.get_process_group_ranks(like))
    if (kind, backend, ranks) not in _GROUPS:
        _make_all(kind, backend, ranks)
    return _GROUPS[(kind, backend, ranks)]


def _make_all(kind: str, backend: str, ranks: tuple[int, ...]) -> None:
    """Every such group (each rank's ``ranks``), made by every rank of the job in one order."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, ranks)
    for members in sorted(set(everyone)):
        group = dist.new_group(list(members), backend=backend)
        if members == ranks:
            _GROUPS[(kind, backend, ranks)] = group
