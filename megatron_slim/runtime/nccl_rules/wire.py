"""What the checker itself sends: fixed-size descriptors, and the call site that names each operation."""

from __future__ import annotations

import json
import os
import sys
from types import FrameType
from typing import Any, Optional

import torch
import torch.distributed as dist

DESCRIPTOR_BYTES = 1024  # a JSON record padded with zeros; long call sites are cut to fit
_SKIPPED = (
    os.path.dirname(dist.__file__) + os.sep,  # torch.distributed's own frames (batch_isend_irecv, *_object)
    os.path.dirname(os.path.abspath(__file__)) + os.sep,  # the checker's
)


class NcclRuleBroken(RuntimeError):
    """An operation that NCCL would match, order or size differently from gloo; the message names the call sites."""


def call_site() -> str:
    """``path:line in function`` of the nearest caller outside torch.distributed and this checker."""
    frame: Optional[FrameType] = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_SKIPPED):
        frame = frame.f_back
    if frame is None:
        return "<unknown>"
    path = frame.f_code.co_filename
    for root in ("site-packages" + os.sep, os.sep + "megatron_slim" + os.sep, os.sep + "tests" + os.sep):
        if root in path:
            path = path[path.rindex(root) + (len(root) if root.startswith("site") else 1) :]
            break
    return f"{path}:{frame.f_lineno} in {frame.f_code.co_name}"


def encode(record: dict[str, Any]) -> torch.Tensor:
    """``record`` as a uint8 tensor of ``DESCRIPTOR_BYTES``; the ``site`` entry is shortened if need be."""
    data = json.dumps(record, separators=(",", ":")).encode()
    if len(data) > DESCRIPTOR_BYTES:
        cut = len(data) - DESCRIPTOR_BYTES + 3
        record = {**record, "site": "..." + str(record.get("site", ""))[cut:]}
        data = json.dumps(record, separators=(",", ":")).encode()
    out = torch.zeros(DESCRIPTOR_BYTES, dtype=torch.uint8)
    out[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return out


def decode(buffer: torch.Tensor) -> dict[str, Any]:
    data = bytes(buffer.tolist()).rstrip(b"\0")
    return json.loads(data) if data else {}


def empty() -> torch.Tensor:
    return torch.zeros(DESCRIPTOR_BYTES, dtype=torch.uint8)


def group_name(group: Optional[Any]) -> str:
    """A communicator's name, the same on every member: the default group's or the one torch gave it."""
    if group is None or group is dist.GroupMember.WORLD:
        return "default"
    return str(getattr(group, "group_name", id(group)))


def global_rank(group: Optional[Any], group_rank: Optional[int], rank: Optional[int]) -> int:
    """The global rank a point-to-point call names, by ``dst``/``src`` or by ``group_dst``/``group_src``."""
    if rank is not None:
        return int(rank)
    if group_rank is None:
        raise NcclRuleBroken("a point-to-point call names no peer: NCCL has no receive from any source")
    if group is None:
        return int(group_rank)
    return int(dist.get_global_rank(group, int(group_rank)))
