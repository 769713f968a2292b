"""Context exchange under query-out context parallelism (:mod:`cp_slice_attention`, zigzag shards).

Each CP rank of the sender stage pairs with the CP rank of the same index on the peer stage (they
share a pipeline group) and ships *its own shards*: its rows of the slice's queries and its shard
of the moved (oldest, whole) cached slices. So the pipeline link carries 1/cp of the slice's Q and
of the moved K/V per CP rank, as ``plan/cost/exchange.py`` prices it.

The peer stage's CP ranks then run the moved block query-out among themselves, as the sender
stage would have: all-gather the shipped query shards, attend every query to the local moved
K/V shard without a mask, and all-to-all the partials back to the rank whose queries they are,
merged by log-sum-exp (forward); all-gather (q, dout, out, lse), the block's exact gradients from
the merged statistics, reduce-scatter (sum) of dQ (backward). Every CP rank of the peer stage
serves the same pair at the same layer (CP ranks run one schedule), so the collectives line up;
they need only the senders' messages, which the senders post before their own collectives.

Row order inside the block does not matter (no mask): queries stay rank-major, never reordered
to positions. The sender merges the returned (out, lse) of its rows into its own combined rows
(forward) and adds the returned dQ to its reduce-scattered dQ and dK/dV to the moved slices'
accumulators (backward), exactly as without CP.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from megatron_slim.runtime.attention import AttentionBackend
from megatron_slim.runtime.pipeline.context_exchange import Attend, ContextExchange, Gradients, Pending, paired_role
from megatron_slim.runtime.pipeline.cp_collectives import all_gather, combine_partials, reduce_scatter_sum

Tensor = torch.Tensor
Opened = tuple[int, Optional[Pending]]  # (cached slices the sender moved, what its peer sends back)


def _joined(gathered: Tensor) -> Tensor:
    """``[cp, b, rows, ...]`` -> ``[b, cp * rows, ...]``, rank-major."""
    return gathered.movedim(0, 1).flatten(1, 2)


def _split(x: Tensor, cp: int, dim: int) -> Tensor:
    """Inverse of :func:`_joined` along ``dim``: ``[cp, ...]``, entry ``i`` holding rank ``i``'s rows."""
    return x.unflatten(dim, (cp, x.shape[dim] // cp)).movedim(dim, 0)


def block_attention(backend: AttentionBackend, scale: float, group) -> tuple[Attend, Gradients]:
    """The peer stage's query-out forward and backward of a shipped block on ``group`` (its CP group)."""
    cp = torch.distributed.get_world_size(group)

    def attend(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        q_all = _joined(all_gather([q], group)[0])
        out, lse = backend.forward(q_all, k, v, causal=False, softmax_scale=scale)
        acc = torch.promote_types(out.dtype, torch.float32)
        mine = combine_partials(_split(out.to(acc), cp, 1), _split(lse.float(), cp, 2), group)
        return mine[0].to(q.dtype), mine[1]

    def gradients(dout: Tensor, q: Tensor, out: Tensor, lse: Tensor, k: Tensor, v: Tensor):
        q_all, dout_all, out_all, lse_all = all_gather([q, dout, out, lse], group)
        dq, dk, dv = backend.backward(
            _joined(dout_all),
            _joined(q_all),
            k,
            v,
            _joined(out_all),
            lse_all.movedim(0, 2).flatten(2, 3),  # [cp, b, h, rows] -> [b, h, cp * rows]
            causal=False,
            softmax_scale=scale,
        )
        return reduce_scatter_sum(_split(dq.float(), cp, 1), group), dk, dv

    return attend, gradients


def moved_kv(prefix: Sequence[tuple[Tensor, Tensor]], first: int) -> tuple[Tensor, Tensor]:
    """This rank's shards of the oldest ``first`` cached slices, joined: what it ships to its peer."""
    return torch.cat([k for k, _ in prefix[:first]], dim=1), torch.cat([v for _, v in prefix[:first]], dim=1)


def moved_count(exchange: ContextExchange, prefix: Sequence[tuple[Tensor, Tensor]]) -> int:
    """How many of the oldest cached slices the current pair moves."""
    return exchange.moved_chunks([k.shape[1] for k, _ in prefix])


def open_forward(exchange: Optional[ContextExchange], setup, q: Tensor, k: Tensor, prefix, recompute: bool) -> Opened:
    """A paired forward's first step at one layer: the sender ships its shards (returns how many cached
    slices moved and what comes back); the peer serves the block before its own attention."""
    if exchange is None or paired_role(exchange, setup.documents is not None, recompute) is None:
        return 0, None
    assert exchange.role is not None
    if exchange.role.sender:
        first = moved_count(exchange, prefix)
        return first, exchange.send_forward(q, *moved_kv(prefix, first))
    exchange.serve_forward(q, k, block_attention(setup.backend, setup.scale, setup.group)[0])
    return 0, None


def open_backward(exchange: Optional[ContextExchange], setup, dout, q, out, lse, k, prefix) -> Opened:
    """:func:`open_forward` for the backward: the sender ships (dout, q, out, lse) and its moved shards."""
    if exchange is None or paired_role(exchange, setup.documents is not None, False) is None:
        return 0, None
    assert exchange.role is not None
    if exchange.role.sender:
        first = moved_count(exchange, prefix)
        return first, exchange.send_backward(dout, q, out, lse, *moved_kv(prefix, first))
    exchange.serve_backward(q, k, block_attention(setup.backend, setup.scale, setup.group)[1])
    return 0, None


def close_backward(pending: Pending, prefix, accumulate) -> Tensor:
    """The peer's block gradients: dK/dV into the moved slices' accumulators (``accumulate(i, dk, dv)``);
    returns the block's fp32 dQ of this rank's query rows."""
    dq, dk, dv = pending.wait()
    start = 0
    for i, (k_i, _) in enumerate(prefix):
        rows = slice(start, start + k_i.shape[1])
        accumulate(i, dk[:, rows], dv[:, rows])
        start = rows.stop
    return dq
