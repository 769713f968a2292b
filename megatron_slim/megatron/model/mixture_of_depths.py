"""Mixture of depths (Raposo et al. 2024) as a megatron-core ``TransformerLayer``.

In a routing layer (every other layer, ``plan.dynmo.depth.routes``) a router (one linear map
``hidden -> 1``, parameter ``mod_router.weight``) scores every token; per sequence the ``k``
tokens with the largest scores (``plan.dynmo.depth.routed_tokens``) run the whole layer as a
shorter sequence of their own (causal attention among them in their original order, with their
original RoPE positions); every other token passes the layer unchanged. A routed token's output is
``x + r * (layer(x) - x)``: the layer's change scaled by its router score ``r``, which puts the
router on the gradient path (the paper's rule).

Causality: the top-k runs over the whole sequence, so whether a token is processed depends on the
scores of later tokens. This is fine for training with teacher forcing (the paper's setting, and
the only use here); autoregressive sampling would need the paper's causal predictor instead.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_slim.plan.dynmo.depth import routed_tokens, routes


class MixtureOfDepthsLayer(TransformerLayer):
    capacity: float = 0.0  # set per class by ``mixture_of_depths_layer``

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.routes:
            self.mod_router = torch.nn.Linear(self.config.hidden_size, 1, bias=False, dtype=self.config.params_dtype)

    @property
    def routes(self) -> bool:
        return routes(self.layer_number - 1, self.capacity)

    def forward(self, *args: Any, **kwargs: Any):
        if not self.routes:
            return super().forward(*args, **kwargs)
        if "hidden_states" in kwargs:
            hidden_states = kwargs.pop("hidden_states")
        else:
            hidden_states, args = args[0], args[1:]
        for key in ("padding_mask", "packed_seq_params"):
            if kwargs.get(key) is not None:
                raise ValueError(f"mixture of depths: allowed {key}: None (tokens are regrouped)")
        s, b, h = hidden_states.shape
        scores = self.mod_router(hidden_states).squeeze(-1)  # [s, b]
        chosen = scores.topk(routed_tokens(s, self.capacity), dim=0).indices.sort(dim=0).values  # [k, b]
        rows = chosen.unsqueeze(-1).expand(-1, -1, h)
        picked = hidden_states.gather(0, rows)
        rotary = kwargs.get("rotary_pos_emb")
        if rotary is not None:
            kwargs["rotary_pos_emb"] = routed_rotary(rotary, chosen)
        if kwargs.get("attention_mask") is not None:
            kwargs["attention_mask"] = routed_mask(kwargs["attention_mask"], chosen)
        output, context = super().forward(picked, *args, **kwargs)
        routed = picked + scores.gather(0, chosen).unsqueeze(-1) * (output - picked)
        return hidden_states.scatter(0, rows, routed), context


def routed_rotary(rotary: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """``[s, 1, 1, d]`` RoPE angles -> ``[k, b, 1, d]``: each routed token keeps its own position."""
    if isinstance(rotary, tuple) or rotary.dim() != 4 or rotary.shape[1] != 1:
        raise ValueError("mixture of depths: allowed rotary_pos_emb: one [s, 1, 1, d] tensor")
    return rotary[:, 0][chosen]


def routed_mask(mask: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """``[b or 1, heads or 1, s, s]`` attention mask (Megatron-LM's data loader makes one) ->
    ``[b, heads or 1, k, k]``: the entries between each sequence's routed tokens."""
    k, b = chosen.shape
    if mask.dim() != 4 or mask.shape[-1] != mask.shape[-2]:
        raise ValueError("mixture of depths: allowed attention_mask: None or one [b, 1, s, s] tensor")
    mask = mask.expand(b, -1, -1, -1)
    heads, s = mask.shape[1], mask.shape[-1]
    index = chosen.t()  # [b, k]
    rows = mask.gather(2, index[:, None, :, None].expand(b, heads, k, s))
    return rows.gather(3, index[:, None, None, :].expand(b, heads, k, k))


@functools.cache
def mixture_of_depths_layer(capacity: float) -> type:
    """The layer class for ``dynmo.mod_capacity = capacity`` (one class per capacity, so a rebuild
    after a live migration gets the same one)."""
    return type("MixtureOfDepthsLayer", (MixtureOfDepthsLayer,), {"capacity": capacity, "__module__": __name__})
