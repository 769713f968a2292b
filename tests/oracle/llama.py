"""An independent pure-torch Llama (RoPE, RMSNorm, SwiGLU, GQA) to check megatron models against.

Weights are kept in the textbook layout (separate q/k/v/o, gate/up/down projections) under short
names; :func:`from_megatron` and :func:`to_megatron` convert to and from megatron's whole-model
names and its fused layouts:

- ``linear_qkv.weight`` ``[ng * (hq/ng + 2) * d, h]`` is grouped per K/V head: for each group g
  the rows are ``q heads g*hq/ng .. (g+1)*hq/ng - 1``, then ``k_g``, then ``v_g``.
- ``linear_fc1.weight`` ``[2F, h]`` is ``[gate; up]``; the MLP is ``down(silu(gate x) * up x)``.

RoPE follows the rotate-half convention (pairs ``(i, i + d/2)``), attention uses torch's SDPA with
``enable_gqa`` (query head i reads K/V head ``i // (hq/hkv)``).
"""

from __future__ import annotations

from typing import Mapping

import torch
import torch.nn.functional as F


def _qkv_split(cfg, fused: torch.Tensor):
    d, hq, ng = cfg.head_dim, cfg.num_attention_heads, cfg.num_query_groups
    per_group = hq // ng
    grouped = fused.reshape(ng, per_group + 2, d, -1)
    q = grouped[:, :per_group].reshape(hq * d, -1)
    k = grouped[:, per_group].reshape(ng * d, -1)
    v = grouped[:, per_group + 1].reshape(ng * d, -1)
    return q, k, v


def _qkv_fuse(cfg, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    d, hq, ng = cfg.head_dim, cfg.num_attention_heads, cfg.num_query_groups
    per_group = hq // ng
    h = q.shape[-1]
    grouped = torch.cat([q.reshape(ng, per_group, d, h), k.reshape(ng, 1, d, h), v.reshape(ng, 1, d, h)], dim=1)
    return grouped.reshape(-1, h)


def from_megatron(cfg, sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Reference weights from megatron whole-model names (fresh leaf tensors)."""
    out = {"embed": sd["embedding.word_embeddings.weight"], "final_norm": sd["decoder.final_layernorm.weight"]}
    if cfg.untie_embeddings_and_output_weights:
        out["lm_head"] = sd["output_layer.weight"]
    for i in range(cfg.num_layers):
        p = f"decoder.layers.{i}."
        q, k, v = _qkv_split(cfg, sd[p + "self_attention.linear_qkv.weight"])
        gate, up = sd[p + "mlp.linear_fc1.weight"].chunk(2, dim=0)
        out.update(
            {
                f"{i}.attn_norm": sd[p + "input_layernorm.weight"],
                f"{i}.wq": q,
                f"{i}.wk": k,
                f"{i}.wv": v,
                f"{i}.wo": sd[p + "self_attention.linear_proj.weight"],
                f"{i}.mlp_norm": sd[p + "pre_mlp_layernorm.weight"],
                f"{i}.w_gate": gate,
                f"{i}.w_up": up,
                f"{i}.w_down": sd[p + "mlp.linear_fc2.weight"],
            }
        )
    return {k: v.detach().clone().requires_grad_(True) for k, v in out.items()}


def to_megatron(cfg, ref: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`from_megatron` (used to map reference gradients onto megatron names)."""
    out = {"embedding.word_embeddings.weight": ref["embed"], "decoder.final_layernorm.weight": ref["final_norm"]}
    if cfg.untie_embeddings_and_output_weights:
        out["output_layer.weight"] = ref["lm_head"]
    for i in range(cfg.num_layers):
        p = f"decoder.layers.{i}."
        out.update(
            {
                p + "input_layernorm.weight": ref[f"{i}.attn_norm"],
                p + "self_attention.linear_qkv.weight": _qkv_fuse(cfg, ref[f"{i}.wq"], ref[f"{i}.wk"], ref[f"{i}.wv"]),
                p + "self_attention.linear_proj.weight": ref[f"{i}.wo"],
                p + "pre_mlp_layernorm.weight": ref[f"{i}.mlp_norm"],
                p + "mlp.linear_fc1.weight": torch.cat([ref[f"{i}.w_gate"], ref[f"{i}.w_up"]], dim=0),
                p + "mlp.linear_fc2.weight": ref[f"{i}.w_down"],
            }
        )
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x: torch.Tensor, base: float) -> torch.Tensor:
    """Rotate-half RoPE on ``x [b, heads, s, d]`` for positions 0..s-1."""
    s, d = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angles = torch.outer(torch.arange(s, dtype=torch.float32), inv_freq)
    cos, sin = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def layer_forward(cfg, w: Mapping[str, torch.Tensor], i: int, x: torch.Tensor) -> torch.Tensor:
    """One decoder layer on ``x [b, s, h]``."""
    b, s, _ = x.shape
    d = cfg.head_dim
    h = rms_norm(x, w[f"{i}.attn_norm"], cfg.norm_epsilon)
    q = (h @ w[f"{i}.wq"].T).view(b, s, -1, d).transpose(1, 2)
    k = (h @ w[f"{i}.wk"].T).view(b, s, -1, d).transpose(1, 2)
    v = (h @ w[f"{i}.wv"].T).view(b, s, -1, d).transpose(1, 2)
    q, k = rope(q, cfg.rotary_base), rope(k, cfg.rotary_base)
    attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    x = x + attn.transpose(1, 2).reshape(b, s, -1) @ w[f"{i}.wo"].T
    h = rms_norm(x, w[f"{i}.mlp_norm"], cfg.norm_epsilon)
    return x + (F.silu(h @ w[f"{i}.w_gate"].T) * (h @ w[f"{i}.w_up"].T)) @ w[f"{i}.w_down"].T


def forward(cfg, w: Mapping[str, torch.Tensor], ids: torch.Tensor) -> tuple[torch.Tensor, list]:
    """Logits ``[b, s, V]`` and each layer's output ``[b, s, h]``."""
    x = F.embedding(ids, w["embed"])
    outputs = []
    for i in range(cfg.num_layers):
        x = layer_forward(cfg, w, i, x)
        outputs.append(x)
    x = rms_norm(x, w["final_norm"], cfg.norm_epsilon)
    head = w["lm_head"] if cfg.untie_embeddings_and_output_weights else w["embed"]
    return x @ head.T, outputs


def token_losses(cfg, w: Mapping[str, torch.Tensor], ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token cross entropy ``[b, s]`` (what megatron's GPTModel returns given labels)."""
    logits, _ = forward(cfg, w, ids)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)


def loss_and_grads(cfg, state: Mapping[str, torch.Tensor], ids: torch.Tensor, labels: torch.Tensor):
    """Per-token losses ``[b, s]`` of the megatron weights ``state`` and the gradient of their mean,
    under megatron's whole-model names."""
    weights = from_megatron(cfg, state)
    losses = token_losses(cfg, weights, ids, labels)
    losses.mean().backward()
    return losses.detach(), to_megatron(cfg, {k: w.grad for k, w in weights.items()})
