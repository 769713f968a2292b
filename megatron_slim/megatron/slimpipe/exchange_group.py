"""The process group context-exchange messages travel on, beside the pipeline group's activations.

Gloo matches a point-to-point message by tag, so the exchange's own tag range keeps its messages
apart from the activations on the pipeline group itself. NCCL ignores tags and matches the messages
between two ranks in posting order; activation receives posted ahead of their action would then
take an exchange message's place. So on any other backend the exchange gets a group of its own over
the same ranks (its own communicators): there both ends of a pair post in one order (the sender
ships, then receives; the peer receives, then replies, layer by layer), and the pairs between two
ranks run in the schedule's order on both.

Making a group is collective over every rank of the job (NCCL splits the new communicator off the
default one, and a split needs all its ranks), so every rank makes every pipeline group's exchange
group, in one order: in the first training call that runs exchange, which every rank makes, since
all pipelines run one kind of schedule from the same flags.
"""

from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist

_GROUPS: dict[tuple[str, tuple[int, ...]], Any] = {}


def exchange_group(pipeline_group: Any, separate: Optional[bool] = None) -> Any:
    """The group for ``pipeline_group``'s exchange messages: itself under gloo, else (or with
    ``separate``) a group of its own over the same ranks, made once per process."""
    backend = str(dist.get_backend(pipeline_group))
    if not (backend != "gloo" if separate is None else separate):
        return pipeline_group
    ranks = tuple(dist.get_process_group_ranks(pipeline_group))
    if (backend, ranks) not in _GROUPS:
        _make_all(backend, ranks)
    return _GROUPS[(backend, ranks)]


def _make_all(backend: str, ranks: tuple[int, ...]) -> None:
    """Every pipeline group's exchange group, made by every rank of the job in one order."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, ranks)
    for members in sorted(set(everyone)):
        group = dist.new_group(list(members), backend=backend)
        if members == ranks:
            _GROUPS[(backend, ranks)] = group
