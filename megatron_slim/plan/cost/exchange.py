"""What one context-exchange pair moves (``plan/schedule/exchange.py``), per GPU and stage.

The sender's slice of ``tokens`` queries attends non-causally to ``moved`` tokens of its K/V
prefix on the peer, layer by layer (one message each way per layer). Per GPU the shares are the
CP-local ones, as in the rest of the model (query-out CP: each CP rank pairs with the same CP rank
of the peer stage).

* forward: Q and the moved K/V go over; ``out`` and fp32 ``lse`` come back.
* backward: Q, ``out``, ``dout``, fp32 ``lse`` and the moved K/V go over; fp32 ``dQ`` and fp32
  ``dK``/``dV`` of the moved block come back (they add into the sender's accumulation buffers).
* the block's attention time: flash attention's rate on ``tokens x moved`` query-key pairs (the
  backward's five matmuls against the forward's two, as ``LayerShape.backward_work``). A recomputed
  layer's repeated forward attention is not moved.
* the peer holds one layer's moved K/V (and, in backward, its fp32 dK/dV) while it computes.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_slim.plan.cost.layer import FP32_BYTES, OpWork
from megatron_slim.plan.cost.model import CostModel


@dataclass(frozen=True)
class ExchangeWork:
    block_s: float  # the moved block's attention time over the stage's layers
    out_bytes: float  # sender -> peer, over the stage's layers
    back_bytes: float  # peer -> sender
    messages: int  # per direction: one per layer
    peer_bytes: float  # held by the peer while it computes one layer's block


def exchange_work(cost: CostModel, tokens: float, moved: float, backward: bool) -> ExchangeWork:
    s, layers = cost.shape, cost.layers_per_stage
    flops = 4 * s.micro_batch * (s.heads / s.tp) * s.head_dim * tokens * moved / s.cp
    block = cost.kernel_time(OpWork(0.0, flops * (2.5 if backward else 1.0), 0.0), backward) * layers
    rows = tokens * s.micro_batch / s.cp
    q = rows * s.hidden / s.tp * cost.element_bytes
    lse = rows * s.heads / s.tp * FP32_BYTES
    kv = s.kv_bytes(moved)
    if backward:
        dq = rows * s.hidden / s.tp * FP32_BYTES
        out, back = 3 * q + lse + kv, dq + s.kv_grad_bytes(moved)
        held = kv + s.kv_grad_bytes(moved)
    else:
        out, back, held = q + kv, q + lse, kv
    return ExchangeWork(block, out * layers, back * layers, layers, held)
