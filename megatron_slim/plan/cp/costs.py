"""Per-unit costs of one decoder layer on one CP rank: what the planners and the CP simulator price.

Built once from a recipe through ``LayerShape`` (the per-GPU FLOP/byte formulas) and
``CostModel.kernel_time`` (rates, efficiencies, calibration), with ``cp=1`` and one microbatch so
that context parallelism is ours to model. Every time is linear in its count: a kernel's rate is
taken at the size of one rank's average share (``seq_length / cp`` tokens), which is exact for
the profile's constant efficiencies and an approximation under a size-dependent calibration.

Token work is split in three parts because they run in different layouts:
* ``pre``: first norm, QKV projection, RoPE (attention layout, before attention);
* ``post``: output projection (attention layout, after attention);
* ``mlp``: second norm, SwiGLU MLP, residual adds (balanced layout when remapping).
The QKV/O GEMM FLOPs split in proportion ``(h + 2 kv) : h``; all elementwise traffic of the
attention half is booked on ``pre``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron_slim.plan.cost.layer import LayerShape, OpWork
from megatron_slim.plan.cost.model import CostModel
from megatron_slim.plan.recipe import Recipe


@dataclass(frozen=True)
class CPCosts:
    pair_fwd_s: float  # one causal query-key pair over all of this rank's heads, forward
    pair_bwd_s: float
    pre_fwd_s: float  # per token
    pre_bwd_s: float
    post_fwd_s: float
    post_bwd_s: float
    mlp_fwd_s: float
    mlp_bwd_s: float
    kv_bytes: float  # K and V of one token (one layer, this rank's TP shard)
    q_bytes: float  # Q (and the attention output, and dQ/dO) of one token
    hidden_bytes: float  # one token of the residual stream (what the remap layer moves)
    heads: int  # attention heads of one TP rank
    kv_heads: int
    flops_per_token: float  # model FLOPs (forward) of one token's linear work, whole TP group
    flops_per_pair: float  # model FLOPs (forward) of one causal pair, whole TP group

    @classmethod
    def from_recipe(cls, recipe: Recipe, cost: CostModel | None = None) -> "CPCosts":
        cost = cost or CostModel(recipe)
        shape = dataclasses.replace(cost.shape, cp=1, micro_batch=1)
        tp = shape.tp
        n = max(1.0, recipe.model.seq_length / recipe.parallel.cp)
        full = shape.forward_work(n, 0.0)
        attn_half = dataclasses.replace(shape, ffn=0).forward_work(n, 0.0)
        h, kv = shape.hidden, shape.kv_width
        pre_share = (h + 2 * kv) / (2 * h + 2 * kv)
        pre = OpWork(attn_half.gemm_flops * pre_share, 0.0, attn_half.memory_bytes)
        post = OpWork(attn_half.gemm_flops * (1 - pre_share), 0.0, 0.0)
        mlp = OpWork(full.gemm_flops - attn_half.gemm_flops, 0.0, full.memory_bytes - attn_half.memory_bytes)
        pairs = n * n / 2
        per_pair = shape.forward_work(1.0, 0.0).attention_flops  # causal_pairs(1, 0) == 1
        attn = OpWork(0.0, per_pair * pairs, 0.0)

        def per_token(work: OpWork, backward: bool) -> float:
            w = OpWork(2 * work.gemm_flops, 0.0, 2 * work.memory_bytes) if backward else work
            return cost.kernel_time(w, backward) / n if (w.gemm_flops or w.memory_bytes) else 0.0

        tp_comm = _tp_collective_time(cost, shape, n) / n
        bwd_attn = OpWork(0.0, 2.5 * attn.attention_flops, 0.0)  # as LayerShape.backward_work
        return cls(
            pair_fwd_s=cost.kernel_time(attn, False) / pairs,
            pair_bwd_s=cost.kernel_time(bwd_attn, True) / pairs,
            pre_fwd_s=per_token(pre, False) + tp_comm,
            pre_bwd_s=per_token(pre, True) + tp_comm,
            post_fwd_s=per_token(post, False),
            post_bwd_s=per_token(post, True),
            mlp_fwd_s=per_token(mlp, False) + 2 * tp_comm,
            mlp_bwd_s=per_token(mlp, True) + 2 * tp_comm,
            kv_bytes=shape.kv_bytes(1.0),
            q_bytes=h / tp * shape.element_bytes,
            hidden_bytes=h / shape.sp * shape.element_bytes,
            heads=shape.heads // tp,
            kv_heads=max(1, shape.groups // tp),
            flops_per_token=tp * (full.gemm_flops / n),
            flops_per_pair=tp * per_pair,
        )

    # ---- helpers ---------------------------------------------------------------------------------
    def attention_s(self, pairs: float, backward: bool) -> float:
        return pairs * (self.pair_bwd_s if backward else self.pair_fwd_s)

    def token_s(self, tokens: float, *, remap: bool) -> float:
        """Forward + backward time of the token work a rank does in the attention layout."""
        per = self.pre_fwd_s + self.pre_bwd_s + self.post_fwd_s + self.post_bwd_s
        if not remap:
            per += self.mlp_fwd_s + self.mlp_bwd_s
        return tokens * per

    def pair_s(self) -> float:
        """Forward + backward seconds per causal pair."""
        return self.pair_fwd_s + self.pair_bwd_s


def _tp_collective_time(cost: CostModel, shape: LayerShape, tokens: float) -> float:
    """One of the four TP collectives of a layer pass (0 without TP), on NVLink."""
    tp = shape.tp
    if tp == 1:
        return 0.0
    hw = cost.hw
    per = shape.tp_collective_bytes(tokens) * (tp - 1) / tp
    return per / hw.nvlink_bandwidth + (tp - 1) * hw.nvlink_latency
