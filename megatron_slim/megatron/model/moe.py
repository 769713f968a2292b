"""megatron-core's MoE layer on CPU: local experts (``SequentialMLP``), no grouped GEMM, no TE.

Two additions to megatron's layer, both in the router:

* ``gating`` runs where the weights are (megatron's moves the router to CUDA unconditionally), and
  adds the router's ``drift_bias`` (``[experts]``, zero unless ``dynmo.moe_drift`` is set) to the
  logits: the synthetic drift of ``plan.dynmo.moe``.
* every routing appends ``(layer index, tokens per expert)`` to ``load_log`` when it is a list, so
  the per-iteration expert load is visible to the profiler and the report.

Expert parallelism is 1: the layer gets the expert groups megatron's ``parallel_state`` made for
``expert_model_parallel_size=1`` beside the model's own groups.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router import TopKRouter

MOE_CONFIG = dict(
    moe_token_dispatcher_type="allgather",
    moe_router_load_balancing_type="none",
    moe_aux_loss_coeff=0.0,
    moe_grouped_gemm=False,
)


class CpuTopKRouter(TopKRouter):
    drift_bias: Optional[torch.Tensor] = None
    load_log: Optional[list] = None

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        logits = torch.nn.functional.linear(input.float(), self.weight.float())
        return logits if self.drift_bias is None else logits + self.drift_bias

    def routing(self, logits: torch.Tensor, *args: Any, **kwargs: Any):
        probs, routing_map = super().routing(logits, *args, **kwargs)
        if self.load_log is not None:
            self.load_log.append((self.layer_number - 1, routing_map.sum(0).tolist()))
        return probs, routing_map


class SlimMoELayer(MoELayer):
    def __init__(self, config, submodules, layer_number: Optional[int] = None, pg_collection=None, **kwargs):
        super().__init__(
            config, submodules, layer_number=layer_number, pg_collection=_with_expert_groups(pg_collection), **kwargs
        )


def _with_expert_groups(pg_collection):
    from megatron.core import parallel_state as ps

    if pg_collection is None:
        return None
    pg_collection.ep = ps.get_expert_model_parallel_group()
    pg_collection.expt_tp = ps.get_expert_tensor_parallel_group()
    pg_collection.tp_ep = ps.get_expert_tensor_and_model_parallel_group()
    pg_collection.expt_dp = ps.get_expert_data_parallel_group()
    pg_collection.tp_ep_pp = ps.get_expert_tensor_model_pipeline_parallel_group()
    pg_collection.tp_dp_cp = ps.get_tensor_and_data_parallel_group(with_context_parallel=True)
    return pg_collection


def moe_mlp_spec():
    """The MLP submodule spec of a MoE layer: megatron's local one with the CPU router."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=2, moe_grouped_gemm=False, normalization="RMSNorm").submodules.mlp
    spec.module = SlimMoELayer
    spec.submodules.router = CpuTopKRouter
    return spec


def routers(chunks) -> list[CpuTopKRouter]:
    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, CpuTopKRouter)]
