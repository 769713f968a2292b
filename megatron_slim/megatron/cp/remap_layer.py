"""Zeppelin's remapping layer as a megatron-core ``TransformerLayer``.

megatron-core has no slot between attention and MLP: ``_forward_mlp`` takes its residual before
``pre_mlp_layernorm``, so the move must happen between ``_forward_attention`` and ``_forward_mlp``
(notes/megatron-core.md section 3). ``RemapTransformerLayer.forward`` is the stock forward plus
two moves: hidden states ``[s, b, h]`` go from the attention layout to the token-balanced layout
(the ``RemapPlan``'s all-to-all) before the MLP block -- norm, MLP and residual add all run
balanced -- and back after it. Both moves are differentiable (backward: the inverse move). The
padding row of a rank the plan leaves empty (``cp.padding``) is not moved and skips the MLP.

Without a remap plan in its context the layer is exactly ``TransformerLayer``. The context is
attached after the build by ``cp.attention.attach_context_parallel``. CUDA graphs must be off:
their ``__call__`` paths bypass ``forward``.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_slim.megatron import compat
from megatron_slim.megatron.cp.padding import split_padding
from megatron_slim.runtime.cp.remap import remap_rows


class RemapTransformerLayer(TransformerLayer):
    cp_context: Any = None  # a megatron_slim.megatron.cp.attention.CPContext

    def forward(self, *args: Any, **kwargs: Any):
        kwargs.pop("dynamic_inference_decode_only", None)
        hidden_states, context = self._forward_attention(*args, **kwargs)
        ctx = self.cp_context
        remap = getattr(ctx, "remap", None)
        mlp_kwargs = dict(
            inference_context=kwargs.get("inference_context"),
            padding_mask=kwargs.get("padding_mask"),
            packed_seq_params=kwargs.get("packed_seq_params"),
        )
        if remap is None:
            return compat.forward_mlp(self, hidden_states, **mlp_kwargs), context
        if self.config.sequence_parallel and self.config.tensor_model_parallel_size > 1:
            raise ValueError(
                "--cp-remap with --sequence-parallel: not supported (each tensor-parallel rank holds "
                "a slice of the CP rank's tokens; the remap plan moves whole CP-rank layouts)"
            )
        if mlp_kwargs["padding_mask"] is not None:
            raise ValueError("padding_mask: allowed value is None with the remap layer (it is in the attention layout)")
        planned, padding = split_padding(hidden_states, ctx.planned_tokens)
        balanced = remap_rows(planned, remap, ctx.comm, ctx.remap_back)
        output = compat.forward_mlp(self, balanced, **mlp_kwargs)
        # a padding row (cp_padding) stays out of the move and passes unchanged
        return torch.cat([remap_rows(output, ctx.remap_back, ctx.comm, remap), padding]), context
