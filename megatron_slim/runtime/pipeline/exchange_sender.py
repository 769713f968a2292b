"""A context-exchange sender's attention without context parallelism (``slice_attention.py``).

The sender's blocks cover the first ``m`` tokens of its K/V prefix in any token ranges
(``ExchangeRole.blocks``); ``[m, prefix)`` plus the slice itself stay with the sender, whose
queries are the last of those keys, so its own call stays bottom-right causal. Forward merges every
block's ``(out, lse)`` with its own by log-sum-exp. Backward ships the merged ``(out, lse)`` with
``dout`` so each block's gradients are exact; the blocks' fp32 ``dK``/``dV`` fill their rows of one
fp32 gradient of the whole prefix, which the caller splits over the cached slices, so a block
boundary may fall inside a slice (a slice's rows ``[0, r)`` moved, ``[r, len)`` kept).
"""

from __future__ import annotations

import torch

from megatron_slim.runtime.attention.merge import merge
from megatron_slim.runtime.pipeline.context_exchange import ContextExchange

Tensor = torch.Tensor


def _cut(prefix: list, k: Tensor, v: Tensor, moved: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """K, V of the prefix's first ``moved`` rows (the blocks'); K, V of the rest joined with the slice's own."""
    keys = torch.cat([k_i for k_i, _ in prefix] + [k], dim=1)
    values = torch.cat([v_i for _, v_i in prefix] + [v], dim=1)
    return keys[:, :moved], values[:, :moved], keys[:, moved:].contiguous(), values[:, moved:].contiguous()


def _per_block(exchange: ContextExchange, k_moved: Tensor, v_moved: Tensor) -> list[tuple[Tensor, Tensor]]:
    rows = [slice(b.kv_start, b.kv_end) for b in exchange.current_role().blocks]
    return [(k_moved[:, r], v_moved[:, r]) for r in rows]


def sender_forward(backend, q: Tensor, k: Tensor, v: Tensor, scale: float, prefix: list, exchange: ContextExchange):
    """The slice's (out, lse): its blocks shipped, its own causal part, all merged by log-sum-exp."""
    k_moved, v_moved, keys, values = _cut(prefix, k, v, exchange.current_role().moved)
    pending = exchange.ship_forward(q, _per_block(exchange, k_moved, v_moved), scale)
    out, lse = backend.forward(q, keys, values, causal=True, softmax_scale=scale)
    merged = (out, lse) if len(pending) == 1 else (out.float(), lse)  # several partials: accumulate in fp32
    for block in pending:
        merged = merge(*merged, *block.wait())
    return merged[0].to(out.dtype), merged[1]


def sender_backward(backend, dout, q, k, v, out, lse, scale: float, prefix: list, exchange: ContextExchange):
    """(dQ with every block's added, the whole prefix's fp32 dK and dV, the slice's own dK and dV)."""
    role = exchange.current_role()
    k_moved, v_moved, keys, values = _cut(prefix, k, v, role.moved)
    pending = exchange.ship_backward(dout, q, out, lse, _per_block(exchange, k_moved, v_moved), scale)
    dq, dkeys, dvalues = backend.backward(dout, q, keys, values, out, lse, causal=True, softmax_scale=scale)
    kept = dkeys.shape[1] - k.shape[1]  # prefix rows of the sender's own call
    shape = (dkeys.shape[0], role.moved + kept, *dkeys.shape[2:])
    dk_prefix = torch.empty(shape, dtype=torch.float32, device=dkeys.device)
    dv_prefix = torch.empty_like(dk_prefix)
    dk_prefix[:, role.moved :], dv_prefix[:, role.moved :] = dkeys[:, :kept], dvalues[:, :kept]
    dq_sum = dq.float()
    for block, work in zip(role.blocks, pending):
        dq_block, dk_block, dv_block = work.wait()
        rows = slice(block.kv_start, block.kv_end)
        dk_prefix[:, rows], dv_prefix[:, rows] = dk_block, dv_block  # the blocks cover [0, moved) once
        dq_sum = dq_sum + dq_block
    return dq_sum.to(dq.dtype), dk_prefix, dv_prefix, dkeys[:, kept:], dvalues[:, kept:]
