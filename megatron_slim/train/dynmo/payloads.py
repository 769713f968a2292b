"""Point-to-point exchange of picklable payloads (dicts of tensors) inside a process group, with no
ordering deadlock: every rank posts all its sends and receives at once, first the sizes, then the
bytes. Each rank must know whom it receives from (DynMo's plans say so on every rank)."""

from __future__ import annotations

import io
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist


def _to_bytes(payload: Any) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def exchange(outgoing: Mapping[int, Any], sources: Iterable[int], group: Any) -> dict[int, Any]:
    """Send ``outgoing[dst]`` to each group rank ``dst``; return ``{src: payload}`` for ``sources``
    (group ranks)."""
    ranks = dist.get_process_group_ranks(group)
    sources = sorted(set(sources))
    blobs = {dst: _to_bytes(payload) for dst, payload in outgoing.items()}
    sizes_out = {dst: torch.tensor([blob.numel()], dtype=torch.int64) for dst, blob in blobs.items()}
    sizes_in = {src: torch.zeros(1, dtype=torch.int64) for src in sources}
    _wait_all(
        [dist.isend(t, dst=ranks[d], group=group) for d, t in sizes_out.items()]
        + [dist.irecv(t, src=ranks[s], group=group) for s, t in sizes_in.items()]
    )
    inbox = {src: torch.empty(int(size.item()), dtype=torch.uint8) for src, size in sizes_in.items()}
    _wait_all(
        [dist.isend(b, dst=ranks[d], group=group) for d, b in blobs.items()]
        + [dist.irecv(b, src=ranks[s], group=group) for s, b in inbox.items()]
    )
    return {src: torch.load(io.BytesIO(blob.numpy().tobytes()), weights_only=True) for src, blob in inbox.items()}


def _wait_all(works: list) -> None:
    for work in works:
        work.wait()
