"""Rank function for the mixture-of-depths tests (spawned by run_ranks; megatron is imported inside it)."""

from __future__ import annotations

import torch

from megatron_slim.plan.recipe import ModelConfig
from tests.oracle.models import TINY_GQA_4L

CAPACITY = 0.25  # 8 of 32 tokens run layers 1 and 3


def _reference_forward(layer, router: torch.Tensor, capacity: float, hidden_states, rotary_pos_emb=None, **kwargs):
    """The rule stated plainly on a stock layer, one sequence at a time: score, keep the
    ``floor(capacity * s)`` best positions in order, run the layer on them alone, scale its change."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    s, b, _ = hidden_states.shape
    k = int(capacity * s)
    columns, context = [], None
    for j in range(b):
        x = hidden_states[:, j : j + 1]  # [s, 1, h]
        scores = x[:, 0] @ router  # [s]
        keep = torch.argsort(scores, descending=True)[:k].sort().values
        y, context = TransformerLayer.forward(
            layer, hidden_states=x[keep], rotary_pos_emb=rotary_pos_emb[keep], **kwargs
        )
        out = x.clone()
        out[keep] = x[keep] + scores[keep].view(k, 1, 1) * (y - x[keep])
        columns.append(out)
    return torch.cat(columns, dim=1), context


def mixture_of_depths(rank, world_size, seed):
    """The mixture-of-depths layer against ``_reference_forward`` on stock layers with the same
    router weights: losses and every gradient; and a run with capacity 1 against stock layers."""
    from megatron_slim.megatron.model.gpt import global_grads
    from megatron_slim.megatron.model.mixture_of_depths import mixture_of_depths_layer
    from megatron_slim.megatron.model.parallel import model_parallel
    from tests.oracle.reference import whole_model

    cfg = ModelConfig(**TINY_GQA_4L)
    g = torch.Generator().manual_seed(seed)
    ids, labels = (torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=g) for _ in range(2))
    out: dict = {}
    with model_parallel(seed=seed) as groups:
        fast = whole_model(cfg, groups, seed, transformer_layer=mixture_of_depths_layer(CAPACITY))
        reference = whole_model(cfg, groups, seed)
        routers = {}
        for layer, stock in zip(fast.decoder.layers, reference.decoder.layers):
            if hasattr(layer, "mod_router"):
                index = layer.layer_number - 1
                routers[index] = layer.mod_router.weight.detach()[0].clone().requires_grad_(True)
                stock.forward = lambda *a, _l=stock, _r=routers[index], **k: _reference_forward(
                    _l, _r, CAPACITY, *a, **k
                )
        stock_model = whole_model(cfg, groups, seed)
        for name, chunk in (("fast", fast), ("reference", reference), ("stock", stock_model)):
            losses = chunk(ids, None, None, labels=labels)
            losses.mean().backward()
            out[name] = {"losses": losses.detach(), "grads": global_grads(chunk)}
        out["reference"]["router_grads"] = {i: r.grad for i, r in routers.items()}
        out["fast"]["router_grads"] = {
            layer.layer_number - 1: layer.mod_router.weight.grad[0]
            for layer in fast.decoder.layers
            if hasattr(layer, "mod_router")
        }
    return out
