"""Rank functions for the megatron tests (spawned by run_ranks; megatron is imported inside them
so that importing this module stays cheap for the parent)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_slim.plan.recipe import ModelConfig
from tests.oracle import reference
from tests.oracle.models import TINY_GQA_4L


def tiny_config(**overrides) -> ModelConfig:
    return ModelConfig(**{**TINY_GQA_4L, **overrides})


def tiny_batch(cfg: ModelConfig, batch_size: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_length), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_length), generator=g)
    return ids, labels


# --------------------------------------------------------------------------- world size 1


def single_process(rank, world_size, seed):
    """A whole model on one rank (untied and tied embeddings), plus megatron's own step functions
    and helpers called through the compat shims, plus the CPU RNG tracker."""
    from megatron_slim.megatron.model.parallel import model_parallel

    out = {"models": {}}
    with model_parallel(seed=seed) as groups:
        for tied in (False, True):
            cfg = tiny_config(untie_embeddings_and_output_weights=not tied)
            out["models"][tied] = _whole_model_step(cfg, groups, seed)
        out.update(_installed_shims(tiny_config(), groups, seed))
    out["rng"] = _rng_streams(seed)
    return out


def _whole_model_step(cfg, groups, seed):
    from megatron_slim.megatron.model.gpt import build_chunk, global_grads, global_state_dict

    ids, labels = tiny_batch(cfg)
    chunk = build_chunk(cfg, groups, layers=range(cfg.num_layers), pre_process=True, post_process=True, seed=seed)
    state = global_state_dict(chunk)
    losses = chunk(ids, None, None, labels=labels)
    losses.mean().backward()
    return {
        "layer_numbers": [layer.layer_number for layer in chunk.decoder.layers],
        "attention_layer_numbers": [layer.self_attention.core_attention.layer_number for layer in chunk.decoder.layers],
        "state": state,
        "losses": losses.detach(),
        "grads": global_grads(chunk),
    }


def _installed_shims(cfg, groups, seed):
    """Call the installed megatron-core through each shim and record what came back."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_slim.megatron import compat
    from megatron_slim.megatron.model.core_attention import SlimCoreAttention
    from megatron_slim.megatron.model.gpt import build_chunk, global_grads

    ids, labels = tiny_batch(cfg)
    chunk = build_chunk(cfg, groups, layers=range(cfg.num_layers), pre_process=True, post_process=True, seed=seed)
    direct = chunk(ids, None, None, labels=labels).mean()
    direct.backward()
    direct_grads = global_grads(chunk)
    chunk.zero_grad(set_to_none=True)

    def forward_step_func(data_iterator, model):
        batch_ids, batch_labels = next(data_iterator)
        token_loss = model(batch_ids, None, None, labels=batch_labels)

        def loss_func(output):
            num_tokens = torch.tensor(output.numel(), dtype=torch.int)
            return output.sum(), num_tokens, {"lm loss": output.detach().mean()}

        return token_loss, loss_func

    loss, _ = compat.forward_step(
        forward_step_func=forward_step_func,
        data_iterator=iter([(ids, labels)]),
        model=chunk,
        num_microbatches=1,
        input_tensor=None,
        forward_data_store=[],
        config=chunk.config,
        cp_group_size=1,
        is_last_stage=True,
    )
    compat.backward_step(None, loss, None, chunk.config)

    # _forward_mlp through its shim equals the MLP sublayer plus its residual.
    layer = chunk.decoder.layers[0]
    hidden = torch.randn(cfg.seq_length, 2, cfg.hidden_size)
    mlp_out = compat.forward_mlp(layer, hidden)
    mlp_out = mlp_out[0] if isinstance(mlp_out, tuple) else mlp_out
    by_hand, _ = layer.mlp(layer.pre_mlp_layernorm(hidden))

    # A core attention built from a spec with the keywords megatron's Attention would pass.
    attention = compat.build(
        ModuleSpec(module=SlimCoreAttention),
        config=chunk.config,
        layer_number=3,
        attn_mask_type=AttnMaskType.causal,
        attention_type="self",
        cp_comm_type=None,
        softmax_scale=None,
        **compat.model_groups_kwargs(_attention_class(), groups),
    )
    return {
        "direct_loss": direct.detach(),
        "direct_grads": direct_grads,
        "shim_loss": loss.detach(),
        "shim_grads": global_grads(chunk),
        "forward_mlp_err": (mlp_out - (hidden + by_hand)).abs().max().item(),
        "built_attention": (attention.layer_number, attention.cp_group is groups.cp),
    }


def _attention_class():
    from megatron.core.transformer.attention import Attention

    return Attention


def _rng_streams(seed):
    """Draws inside the tensor-parallel fork for two tp ranks, and the default stream around it."""
    from megatron.core import tensor_parallel

    from megatron_slim.megatron.model.rng import reset_rng_tracker, seed_model_parallel_rng

    draws = {}
    for tp_rank in (0, 1, 0):
        seed_model_parallel_rng(seed, tp_rank=tp_rank)
        before = torch.rand(3)
        with tensor_parallel.get_cuda_rng_tracker().fork():
            inside = torch.rand(3)
        after = torch.rand(3)
        draws.setdefault(tp_rank, []).append((before, inside, after))
        reset_rng_tracker()
    torch.manual_seed(seed)
    plain = torch.rand(6)
    return {"draws": draws, "plain": plain}


# --------------------------------------------------------------------------- world size 2


def _run_stages_by_hand(cfg, chunks_by_stage, my_rank, pp, ids, labels):
    """Forward then backward through ``pp * vpp`` stages owned round-robin by the pp ranks,
    passing activations and their gradients with send/recv. Returns this rank's per-layer outputs
    and (on the last stage's owner) the per-token losses."""
    num_stages = len(chunks_by_stage)
    layer_out: dict[int, torch.Tensor] = {}
    saved = {}
    losses = None
    shape = (cfg.seq_length, ids.shape[0], cfg.hidden_size)
    for s in range(num_stages):
        if s % pp != my_rank:
            continue
        chunk = chunks_by_stage[s]
        hooks = reference.layer_output_hooks(chunk, layer_out)
        if s == 0:
            inp = None
            chunk.set_input_tensor(None)
            output = chunk(ids, None, None)
        else:
            inp = torch.empty(shape)
            dist.recv(inp, src=(s - 1) % pp)
            inp.requires_grad_(True)
            chunk.set_input_tensor(inp)
            output = chunk(None, None, None, labels=labels if s == num_stages - 1 else None)
        for h in hooks:
            h.remove()
        saved[s] = (inp, output)
        if s == num_stages - 1:
            losses = output.detach()
        else:
            dist.send(output.detach().contiguous(), dst=(s + 1) % pp)
    for s in reversed(range(num_stages)):
        if s % pp != my_rank:
            continue
        inp, output = saved[s]
        if s == num_stages - 1:
            output.mean().backward()
        else:
            grad = torch.empty(shape)
            dist.recv(grad, src=(s + 1) % pp)
            output.backward(grad)
        if inp is not None:
            dist.send(inp.grad.contiguous(), dst=(s - 1) % pp)
    return layer_out, losses


def _pipeline_case(cfg, groups, chunk_seed, full_seed):
    from megatron_slim.megatron.model.gpt import (
        build_rank_chunks,
        global_grads,
        global_state_dict,
        load_global_state_dict,
        stage_layers,
    )

    ids, labels = tiny_batch(cfg)
    ref = reference.token_mean_step(cfg, groups, full_seed, ids, labels)
    chunks = build_rank_chunks(cfg, groups, seed=chunk_seed)
    result = {
        "expected_layers": stage_layers(cfg.num_layers, groups.pp_size, groups.vpp)[groups.pp_rank],
        "layer_numbers": [[layer.layer_number for layer in c.decoder.layers] for c in chunks],
        "roles": [(c.slim_chunk_info.pre_process, c.slim_chunk_info.post_process) for c in chunks],
        "init_state": [global_state_dict(c) for c in chunks],
    }
    for c in chunks:
        load_global_state_dict(c, ref["state"])
    stages = {c_idx * groups.pp_size + groups.pp_rank: c for c_idx, c in enumerate(chunks)}
    chunks_by_stage = [stages.get(s) for s in range(groups.pp_size * groups.vpp)]
    layer_out, losses = _run_stages_by_hand(cfg, chunks_by_stage, groups.pp_rank, groups.pp_size, ids, labels)
    result.update(ref=ref, layer_out=layer_out, losses=losses, grads=[global_grads(c) for c in chunks])
    return result


def two_ranks(rank, world_size, seed):
    from megatron_slim.megatron.model.parallel import model_parallel

    out = {}
    cfg = tiny_config()
    with model_parallel(pp=2, seed=seed) as groups:
        out["pp2"] = _pipeline_case(cfg, groups, chunk_seed=seed + 1, full_seed=seed)
        tied = tiny_config(untie_embeddings_and_output_weights=False)
        out["pp2_tied"] = _pipeline_case(tied, groups, chunk_seed=seed, full_seed=seed)
    with model_parallel(pp=2, vpp=2, seed=seed) as groups:
        out["vpp2"] = _pipeline_case(cfg, groups, chunk_seed=seed + 1, full_seed=seed)
    out["sizes"] = {}
    for sizes in (dict(tp=2), dict(cp=2), dict(pp=2), dict()):
        with model_parallel(**sizes) as groups:
            out["sizes"][tuple(sorted(sizes.items()))] = {
                name: (getattr(groups, f"{name}_size"), getattr(groups, f"{name}_rank"))
                for name in ("tp", "pp", "cp", "dp")
            }
    out["tp2"] = _tensor_parallel_case(seed)
    return out


def _tensor_parallel_case(seed):
    """tp=2: a sharded whole model loaded from unsharded weights; its loss and sharded grads."""
    from megatron_slim.megatron.model.gpt import build_chunk, global_grads, global_state_dict, load_global_state_dict
    from megatron_slim.megatron.model.parallel import model_parallel

    cfg = tiny_config()
    ids, labels = tiny_batch(cfg)
    with model_parallel(tp=2, seed=seed) as groups:
        chunk = build_chunk(
            cfg, groups, layers=range(cfg.num_layers), pre_process=True, post_process=True, seed=seed + 1
        )
        full_state = reference.unsharded_state(cfg, seed)
        load_global_state_dict(chunk, full_state)
        losses = chunk(ids, None, None, labels=labels)
        losses.mean().backward()
        return {
            "full_state": full_state,
            "state": global_state_dict(chunk),
            "losses": losses.detach(),
            "grads": global_grads(chunk),
            "tp_rank": groups.tp_rank,
            "tp_size": groups.tp_size,
        }
