"""Rank function for the MoE tests (spawned by run_ranks; megatron is imported inside it)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_slim.plan.dynmo.moe import drift_bias
from megatron_slim.plan.recipe import ModelConfig
from tests.oracle.models import TINY_GQA_4L

EXPERTS, TOPK, DRIFT = 4, 2, 1.0


def _hand_moe(mlp, hidden_states, bias, counts: list, **kwargs):
    """Top-k routing written out: softmax over each token's ``TOPK`` largest logits, experts as
    plain SwiGLU matmuls, outputs summed with those weights."""
    s, b, h = hidden_states.shape
    tokens = hidden_states.reshape(s * b, h)
    logits = tokens @ mlp.router.weight.t() + (0 if bias is None else bias)
    top, chosen = logits.topk(TOPK, dim=-1)
    probs = torch.softmax(top, dim=-1)
    out = torch.zeros_like(tokens)
    for e, expert in enumerate(mlp.experts.local_experts):
        gate, up = (tokens @ expert.linear_fc1.weight.t()).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ expert.linear_fc2.weight.t()
        out = out + (probs * (chosen == e)).sum(-1, keepdim=True) * y
    counts.append([int((chosen == e).sum()) for e in range(EXPERTS)])
    return out.view(s, b, h), None


def moe(rank, world_size, seed):
    """MoE chunks (``moe_build_kwargs``) against the same weights routed by ``_hand_moe``: losses,
    gradients and tokens per expert, at iteration 1 (no drift) and iteration 6 (drift bias)."""
    from megatron_slim.megatron.model.gpt import global_grads
    from megatron_slim.megatron.model.parallel import model_parallel
    from megatron_slim.train.dynmo.moe_load import ExpertLoad, moe_build_kwargs
    from tests.oracle.reference import whole_model

    cfg = ModelConfig(**TINY_GQA_4L)
    g = torch.Generator().manual_seed(seed)
    ids, labels = (torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=g) for _ in range(2))
    out: dict = {}
    with model_parallel(seed=seed) as groups:
        build = moe_build_kwargs(EXPERTS, TOPK, cfg.ffn_hidden_size)
        fast, reference = whole_model(cfg, groups, seed, **build), whole_model(cfg, groups, seed, **build)
        load = ExpertLoad([fast], EXPERTS, DRIFT)
        for iteration in (1, 6):
            bias = torch.tensor(drift_bias(iteration, EXPERTS, DRIFT)) if iteration > 1 else None
            hand_counts: list = []
            for layer in reference.decoder.layers:
                layer.mlp.forward = lambda x, *a, _m=layer.mlp, **k: _hand_moe(_m, x, bias, hand_counts)
            load.before(iteration)
            result = {}
            for name, chunk in (("fast", fast), ("reference", reference)):
                chunk.zero_grad(set_to_none=True)
                losses = chunk(ids, None, None, labels=labels)
                losses.mean().backward()
                result[name] = {"losses": losses.detach(), "grads": global_grads(chunk)}
            result["load"], result["hand_load"] = load.finish(), dict(enumerate(hand_counts))
            out[iteration] = result
        out["param_names"] = [n for n, _ in fast.named_parameters()]
    return out
