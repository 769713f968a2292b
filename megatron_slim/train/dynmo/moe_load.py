"""Per-iteration expert load of the MoE layers (``dynmo.moe_experts``) and the synthetic drift.

``before(iteration)`` sets every router's drift bias (``plan.dynmo.moe.drift_bias``) and starts a
new count; ``finish()`` returns, per global layer index of this rank, the tokens routed to each
expert in the iteration (all microbatches; a token counts once per expert it goes to).
"""

from __future__ import annotations

import torch

from megatron_slim.plan.dynmo.moe import drift_bias


class ExpertLoad:
    def __init__(self, chunks, experts: int, drift: float) -> None:
        from megatron_slim.megatron.model.moe import routers

        self.routers, self.experts, self.drift = routers(chunks), experts, drift
        self.log: list = []
        for router in self.routers:
            router.load_log = self.log

    def before(self, iteration: int) -> None:
        self.log.clear()
        bias = torch.tensor(drift_bias(iteration, self.experts, self.drift)) if self.drift else None
        for router in self.routers:
            router.drift_bias = bias

    def finish(self) -> dict[int, list[int]]:
        load: dict[int, list[int]] = {}
        for layer, counts in self.log:
            total = load.setdefault(layer, [0] * self.experts)
            for e, n in enumerate(counts):
                total[e] += int(n)
        return dict(sorted(load.items()))


def moe_build_kwargs(experts: int, topk: int, ffn_hidden_size: int) -> dict:
    """``build_rank_chunks`` keywords for MoE layers: the MLP spec and the config fields. The weights
    of a token's experts are the softmax over their logits; with one expert per token, the softmax
    over all logits instead (megatron's pre-softmax: a softmax over one logit is 1 and the router
    would get no gradient)."""
    from megatron_slim.megatron.model.moe import MOE_CONFIG, moe_mlp_spec

    return dict(
        mlp=moe_mlp_spec(),
        num_moe_experts=experts,
        moe_router_topk=topk,
        moe_ffn_hidden_size=ffn_hidden_size,
        moe_router_pre_softmax=topk == 1,
        **MOE_CONFIG,
    )
