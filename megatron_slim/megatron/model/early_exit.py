"""Early exit as a megatron-core ``TransformerLayer``: tokens leave after a confident layer.

Rule (``ExitRule``): a token skips decoder layer ``l >= from_layer`` when its confidence on entering
``l`` is at least ``threshold``. The confidence is parameter-free and cheap (O(hidden) per token):
the largest softmax probability of the token's RMS-normalised hidden state, i.e. how concentrated
it is -- a stand-in for a trained exit classifier that needs no extra weights or training.

Semantics of a skipped (exited) token in layer ``l``: its hidden state leaves the layer unchanged;
its row of the attention block is computed (it still serves as key and value to the active tokens,
as CALM's state propagation does) and discarded; the MLP block (norm, MLP, residual) runs only on
the active tokens, gathered by ``index_select`` and scattered back. Because an exited token's state
no longer changes, its confidence stays at or above the threshold in every later layer: the rule
is memoryless, so later pipeline stages re-derive who exited from the hidden states they receive
and no mask travels between stages. The final norm, output layer and loss see every token.

``reference_exit_forward`` states the same rule on a stock layer (whole layer on every token, then
a select), for tests.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional

import torch
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.utils import make_viewless_tensor

from megatron_slim.megatron import compat


@dataclass(frozen=True)
class ExitRule:
    threshold: float
    from_layer: int  # global 0-based index of the first layer a token may skip

    def active(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[s, b]`` bool: the tokens that still run the layer."""
        with torch.no_grad():
            return token_confidence(hidden_states) < self.threshold

    def applies(self, layer_index: int) -> bool:
        return layer_index >= self.from_layer


def token_confidence(hidden_states: torch.Tensor) -> torch.Tensor:
    """``[s, b, h] -> [s, b]``: largest softmax probability of each RMS-normalised hidden state."""
    h = hidden_states.float()
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    return torch.softmax(normed, dim=-1).amax(-1)


class EarlyExitTransformerLayer(TransformerLayer):
    exit_rule: Optional[ExitRule] = None  # per layer: ``attach_exit_rule``, per class: ``early_exit_layer``
    exit_counts: Optional[list] = None  # when a list: (layer index, active tokens, tokens) per forward

    def forward(self, *args: Any, **kwargs: Any):
        rule, index = self.exit_rule, self.layer_number - 1
        if rule is None or not rule.applies(index):
            return super().forward(*args, **kwargs)
        kwargs.pop("dynamic_inference_decode_only", None)
        if "hidden_states" in kwargs:
            hidden_states = kwargs.pop("hidden_states")
        else:
            hidden_states, args = args[0], args[1:]
        active = rule.active(hidden_states)
        if self.exit_counts is not None:
            self.exit_counts.append((index, int(active.sum()), active.numel()))
        attended, context = self._forward_attention(hidden_states, *args, **kwargs)
        attended = torch.where(active.unsqueeze(-1), attended, hidden_states)
        s, b, h = attended.shape
        flat = attended.reshape(s * b, h)
        rows = active.reshape(-1).nonzero().squeeze(1)
        mlp_in = flat.index_select(0, rows).unsqueeze(1)  # [active tokens, 1, h]
        if kwargs.get("padding_mask") is not None or kwargs.get("packed_seq_params") is not None:
            raise ValueError("early exit: allowed padding_mask / packed_seq_params: None (tokens are regrouped)")
        mlp_out = compat.forward_mlp(self, mlp_in, inference_context=kwargs.get("inference_context"))
        output = flat.index_copy(0, rows, mlp_out.squeeze(1)).view(s, b, h)
        # a stage's output must own its storage: Megatron's pipeline frees it after sending it
        return make_viewless_tensor(inp=output, requires_grad=output.requires_grad, keep_graph=True), context


def attach_exit_rule(chunks, rule: Optional[ExitRule], counts: Optional[list] = None) -> int:
    """Give every ``EarlyExitTransformerLayer`` of ``chunks`` the rule; returns how many there were."""
    n = 0
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, EarlyExitTransformerLayer):
                module.exit_rule, module.exit_counts = rule, counts
                n += 1
    return n


@functools.cache
def early_exit_layer(threshold: float, from_layer: int) -> type:
    """The layer class that carries ``ExitRule(threshold, from_layer)`` from construction on (for
    model builders that take a class, not instances: Megatron-LM's, through the launcher)."""
    rule = ExitRule(threshold, from_layer)
    return type("EarlyExitTransformerLayer", (EarlyExitTransformerLayer,), {"exit_rule": rule, "__module__": __name__})


def reference_exit_forward(layer: TransformerLayer, rule: ExitRule, hidden_states: torch.Tensor, **kwargs):
    """The rule stated plainly on a stock layer: run it on every token, keep the exited tokens' input."""
    output, context = TransformerLayer.forward(layer, hidden_states=hidden_states, **kwargs)
    if not rule.applies(layer.layer_number - 1):
        return output, context
    return torch.where(rule.active(hidden_states).unsqueeze(-1), output, hidden_states), context
