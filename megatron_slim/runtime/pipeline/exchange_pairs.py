"""A mirrored pair's messages under context parallelism (``runtime/pipeline/cp_exchange.py``).

With CP each action is in one block at most, both ends in one pass, and the peer serves at its own
attention layers (its CP ranks run the block query-out together, by collectives, so the serving
must sit where every CP rank of the stage is): the sender ships and posts its receives before its
own attention, the peer receives, computes the block (``attend``/``gradients``) and replies before
its own. ``ContextExchange`` mixes these in; it supplies ``_role``, ``_next_layer``, the group and the
counters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from megatron_slim.runtime.pipeline.context_exchange import ExchangeRole

Tensor = torch.Tensor
Attend = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]  # (q, k, v) -> the block's (out, lse)
Gradients = Callable[..., tuple[Tensor, Tensor, Tensor]]  # (dout, q, out, lse, k, v) -> (dq, dk, dv)


def unmasked(backend, scale: float) -> tuple[Attend, Gradients]:
    """The block's forward and backward without context parallelism: plain unmasked attention."""

    def attend(q, k, v):
        return backend.forward(q, k, v, causal=False, softmax_scale=scale)

    def gradients(dout, q, out, lse, k, v):
        return backend.backward(dout, q, k, v, out, lse, causal=False, softmax_scale=scale)

    return attend, gradients


class Pending:
    """A sender's messages of one layer in flight; ``wait`` returns what the peer sent back."""

    def __init__(self, sends: list, receives: list, buffers: tuple[torch.Tensor, ...]) -> None:
        self._sends, self._receives, self._buffers = sends, receives, buffers

    def wait(self) -> tuple[torch.Tensor, ...]:
        for work in self._receives + self._sends:
            work.wait()
        return self._buffers


class PairMessages:
    """The sender's and the peer's per-layer messages of a pair (one block ``[0, moved)``)."""

    group: Any
    pp_ranks: list[int]
    shards: int
    sent_tokens: int
    served_blocks: int
    _action: Any

    def _role(self) -> "ExchangeRole":  # supplied by ContextExchange
        raise NotImplementedError

    def _next_layer(self) -> int:  # supplied by ContextExchange
        raise NotImplementedError

    def moved_chunks(self, chunk_lengths: Sequence[int]) -> int:
        """How many of the oldest cached chunks (``chunk_lengths`` local rows each) the pair moves."""
        role, total = self._role(), 0
        for count, length in enumerate(chunk_lengths, start=1):
            total += length * self.shards
            if total == role.moved:
                return count
        raise RuntimeError(
            f"context exchange: {self._action} moves {role.moved} tokens, not a whole number of its "
            f"cached slices ({list(chunk_lengths)})"
        )

    # ---- the sender ---------------------------------------------------------------------------
    def send_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Pending:
        """Ship Q and the moved K/V; ``wait()`` -> the block's (out, lse)."""
        role, tag = self._role(), self._next_layer()
        b, s, hq, _ = q.shape
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty(b, hq, s, dtype=torch.float32, device=q.device)
        self.sent_tokens += role.moved_rows
        return self._exchange(role, tag, (q, k, v), (out, lse))

    def send_backward(self, dout, q, out, lse, k, v) -> Pending:
        """Ship what the block's backward needs; ``wait()`` -> fp32 (dQ, dK, dV) of the block."""
        role, tag = self._role(), self._next_layer()
        grads = (torch.empty(q.shape, dtype=torch.float32, device=q.device),) + tuple(
            torch.empty(t.shape, dtype=torch.float32, device=t.device) for t in (k, v)
        )
        self.sent_tokens += role.moved_rows
        return self._exchange(role, tag, (dout, q, out, lse, k, v), grads)

    def _exchange(self, role: ExchangeRole, tag: int, payload: tuple, buffers: tuple) -> Pending:
        other = self.pp_ranks[role.other]
        sends = [dist.isend(t.detach().contiguous(), other, self.group, tag + i) for i, t in enumerate(payload)]
        first = tag + len(payload)
        receives = [dist.irecv(t, other, self.group, first + i) for i, t in enumerate(buffers)]
        return Pending(sends, receives, buffers)

    # ---- the peer -----------------------------------------------------------------------------
    def serve_forward(self, q_like: Tensor, kv_like: Tensor, attend: Attend) -> None:
        """Attend the sender's Q to its moved K/V, unmasked (``attend``), and return (out, lse)."""
        role, tag = self._role(), self._next_layer()
        kv_shape = self._kv_shape(role, kv_like)
        q, k, v = self._receive(role, tag, (self._q_shape(role, q_like), kv_shape, kv_shape), q_like)
        out, lse = attend(q, k, v)
        self._reply(role, tag + 3, (out, lse.float()))

    def serve_backward(self, q_like: Tensor, kv_like: Tensor, gradients: Gradients) -> None:
        """The block's backward for the sender (``gradients``): fp32 (dQ, dK, dV) go back."""
        role, tag = self._role(), self._next_layer()
        q_shape, kv_shape = self._q_shape(role, q_like), self._kv_shape(role, kv_like)
        b, s, hq, _ = q_shape
        shapes = (q_shape, q_shape, q_shape, (b, hq, s), kv_shape, kv_shape)
        dout, q, out, lse, k, v = self._receive(role, tag, shapes, q_like, lse_at=3)
        dq, dk, dv = gradients(dout, q, out, lse, k, v)
        self._reply(role, tag + 6, (dq.float(), dk.float(), dv.float()))

    def _receive(self, role, tag: int, shapes, like: torch.Tensor, lse_at: int = -1) -> list[torch.Tensor]:
        other, got = self.pp_ranks[role.other], []
        for i, shape in enumerate(shapes):
            dtype = torch.float32 if i == lse_at else like.dtype
            buffer = torch.empty(tuple(shape), dtype=dtype, device=like.device)
            dist.recv(buffer, other, self.group, tag + i)
            got.append(buffer)
        self.served_blocks += 1
        return got

    def _reply(self, role: ExchangeRole, tag: int, tensors: tuple) -> None:
        other = self.pp_ranks[role.other]
        works = [dist.isend(t.detach().contiguous(), other, self.group, tag + i) for i, t in enumerate(tensors)]
        for work in works:  # the sender posted these receives with its sends
            assert work is not None  # None only for a rank outside the group
            work.wait()

    @staticmethod
    def _q_shape(role: ExchangeRole, q_like: torch.Tensor) -> tuple[int, ...]:
        b, _, hq, d = q_like.shape
        return (b, role.query_rows, hq, d)

    @staticmethod
    def _kv_shape(role: ExchangeRole, kv_like: torch.Tensor) -> tuple[int, ...]:
        b, _, hkv, d = kv_like.shape
        return (b, role.moved_rows, hkv, d)
