"""What context-exchange messages look like on the wire: their tags and the per-layer header.

Tags sit in their own range, above the schedule's and the vocabulary exchange's, one slot of
``MESSAGES`` per (block, layer): gloo matches messages by tag, so they never take the place of an
activation on the same link, and two blocks between the same ranks never take each other's.

A block's sender opens every layer (cp = 1) with a header: the shapes and dtype of what follows,
so the taker's server needs nothing from its own layers to receive it. A header with no batch rows
(``DONE``) ends the block: the sender has run all its attention layers.
Layer slot layout: 0 header; forward 1-3 (q, k, v) and 4-5 (out, lse) back; backward 1-6
(dout, q, out, lse, k, v) and 7-9 (dq, dk, dv) back. Under CP a CP rank may hold none of a block's
K/V rows (zigzag shards): an empty tensor is never posted, on either end (both know its shape from
the header), and keeps its slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

TAG_BASE = 2**30  # above the schedule's tags and the vocabulary exchange's (both far below)
MESSAGES = 16  # message slots per (block, layer)
TAG_SPAN = 2**30 - MESSAGES  # every tag stays below 2**31 - 1
LAYERS = 4096  # layer slots per block
DONE = 0  # a header's batch size that ends the block
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
Tensor = torch.Tensor
Attend = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]  # (q, k, v) -> the block's (out, lse)
Gradients = Callable[..., tuple[Tensor, Tensor, Tensor]]  # (dout, q, out, lse, k, v) -> (dq, dk, dv)


def layer_tag(block_index: int, layer: int) -> int:
    """The first tag of a block's messages at one layer (its header's)."""
    return TAG_BASE + ((block_index * LAYERS + layer) * MESSAGES) % TAG_SPAN


@dataclass(frozen=True)
class Header:
    """Shapes of one layer's block: ``q [batch, q_rows, q_heads, dim]``, ``k``/``v [batch, kv_rows, kv_heads, dim]``."""

    batch: int
    q_rows: int
    q_heads: int
    dim: int
    kv_rows: int
    kv_heads: int
    dtype: torch.dtype
    scale: float  # the sender's softmax scale

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor, scale: float) -> "Header":
        b, s, hq, d = q.shape
        return cls(b, s, hq, d, k.shape[1], k.shape[2], q.dtype, scale)

    @property
    def done(self) -> bool:
        return self.batch == DONE

    @property
    def q_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.q_rows, self.q_heads, self.dim)

    @property
    def kv_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.kv_rows, self.kv_heads, self.dim)

    @property
    def lse_shape(self) -> tuple[int, int, int]:
        return (self.batch, self.q_heads, self.q_rows)

    def encode(self, device: torch.device) -> torch.Tensor:
        fields = [self.batch, self.q_rows, self.q_heads, self.dim, self.kv_rows, self.kv_heads]
        scale_bits = int(torch.tensor([self.scale], dtype=torch.float64).view(torch.int64))
        return torch.tensor([*fields, _DTYPES.index(self.dtype), scale_bits], dtype=torch.int64, device=device)

    @classmethod
    def decode(cls, t: torch.Tensor) -> "Header":
        t = t.cpu()
        b, s, hq, d, kv, hkv, code = (int(x) for x in t[:7].tolist())
        return cls(b, s, hq, d, kv, hkv, _DTYPES[code], float(t[7:].view(torch.float64)))


def empty_header(device: torch.device) -> torch.Tensor:
    """A receive buffer for a header."""
    return torch.empty(8, dtype=torch.int64, device=device)


def done_header(device: torch.device) -> torch.Tensor:
    return Header(DONE, 0, 0, 0, 0, 0, torch.float32, 0.0).encode(device)


def wait_all(works) -> None:
    """Wait for point-to-point works (``None`` only for a rank outside the group: never here)."""
    for work in works:
        assert work is not None
        work.wait()


def post(op, tensors, peer: int, group, tag: int) -> list:
    """``op`` (``dist.isend``/``dist.irecv``) of ``tensors[i]`` at ``tag + i``, skipping empty ones."""
    return [op(t, peer, group, tag + i) for i, t in enumerate(tensors) if t.numel() > 0]


class Pending:
    """A sender's messages of one block at one layer in flight; ``wait`` returns what came back."""

    def __init__(self, sends: list, receives: list, buffers: tuple[Tensor, ...]) -> None:
        self._sends, self._receives, self._buffers = sends, receives, buffers

    def wait(self) -> tuple[Tensor, ...]:
        wait_all(self._receives + self._sends)
        return self._buffers
