"""Reference runs of the unsliced, unsharded model on one process, built by megatron-core: the loss
and every parameter gradient (under whole-model names) that the pipelined, sliced, tensor- and
context-parallel runs must reproduce. megatron is imported inside the functions so that importing
this module stays cheap for a test's parent process."""

from __future__ import annotations

import torch
import torch.distributed as dist

# the reference as a ``megatron-slim train --set`` run: one stage, whole sequences
UNPIPELINED_UNSLICED = ("parallel.pp=1", "schedule.kind=1f1b", "schedule.num_slices=1")


def solo_groups(rank: int, world_size: int):
    """Groups of size one, for the reference model on one rank of a multi-rank world (every rank
    creates every group, as ``new_group`` requires)."""
    from megatron_slim.megatron.model.parallel import ParallelGroups

    solo = [dist.new_group([r]) for r in range(world_size)][rank]
    return ParallelGroups(tp=solo, pp=solo, cp=solo, dp=solo, dp_cp=solo, tp_cp=solo, mp=solo, embd=solo, pos_embd=solo)


def whole_model(model_cfg, groups, seed: int, **layer_classes):
    """Every layer, the embedding and the head in one chunk (chunk building ignores the pp group)."""
    from megatron_slim.megatron.model.gpt import build_chunk

    return build_chunk(
        model_cfg,
        groups,
        layers=range(model_cfg.num_layers),
        pre_process=True,
        post_process=True,
        seed=seed,
        **layer_classes,
    )


def unsharded_state(model_cfg, seed: int) -> dict[str, torch.Tensor]:
    """The whole untied model's initial weights, computed without building it (init is by name)."""
    from megatron_slim.megatron.model.weights import init_full_tensor

    h, f, v = model_cfg.hidden_size, model_cfg.ffn_hidden_size, model_cfg.vocab_size
    qkv_rows = (model_cfg.num_attention_heads + 2 * model_cfg.num_query_groups) * model_cfg.head_dim
    shapes = {
        "embedding.word_embeddings.weight": (v, h),
        "decoder.final_layernorm.weight": (h,),
        "output_layer.weight": (v, h),
    }
    for i in range(model_cfg.num_layers):
        p = f"decoder.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "self_attention.linear_qkv.weight": (qkv_rows, h),
                p + "self_attention.linear_proj.weight": (h, model_cfg.num_attention_heads * model_cfg.head_dim),
                p + "pre_mlp_layernorm.weight": (h,),
                p + "mlp.linear_fc1.weight": (2 * f, h),
                p + "mlp.linear_fc2.weight": (h, f),
            }
        )
    return {n: init_full_tensor(n, s, seed=seed, num_layers=model_cfg.num_layers) for n, s in shapes.items()}


def layer_output_hooks(chunk, store: dict):
    """Record each decoder layer's hidden-state output ``[s, b, h]`` under its global index."""

    def hook(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        store[module.layer_number - 1] = hidden.detach().clone()

    return [layer.register_forward_hook(hook) for layer in chunk.decoder.layers]


def token_mean_step(model_cfg, groups, seed: int, ids, labels) -> dict:
    """The whole model on ``ids [b, s]``: backward of the mean per-token loss. Returns the initial
    state, the gradients, each layer's output and the per-token losses."""
    from megatron_slim.megatron.model.gpt import global_grads, global_state_dict

    model = whole_model(model_cfg, groups, seed)
    layer_out: dict[int, torch.Tensor] = {}
    hooks = layer_output_hooks(model, layer_out)
    losses = model(ids, None, None, labels=labels)
    losses.mean().backward()
    for h in hooks:
        h.remove()
    return {
        "state": global_state_dict(model),
        "grads": global_grads(model),
        "layer_out": layer_out,
        "losses": losses.detach(),
    }


def microbatch_mean_step(run_microbatch, batches) -> list:
    """Megatron's normalisation without a pipeline: each microbatch's ``(loss sum, token count, report)``
    from ``run_microbatch(batch)``, the loss divided by its count and by the number of microbatches,
    one backward of the sum. Returns each microbatch's ``report["lm loss"]``."""
    reports, total = [], 0.0
    for batch in batches:
        loss, num_tokens, report = run_microbatch(batch)
        total = total + loss / num_tokens.clamp(min=1) / len(batches)
        reports.append(report["lm loss"])
    total.backward()
    return reports


def unsliced_step(model_cfg, groups, batches, seed: int):
    """The whole model with SlimPipe's attention but no slices, the training job's own forward and
    loss functions, Megatron's per-microbatch normalisation. Returns (reports, grads)."""
    from megatron_slim.megatron.model.gpt import global_grads
    from megatron_slim.megatron.slimpipe.slicing import SliceCoreAttention
    from megatron_slim.train.microbatch import loss_func

    model = whole_model(model_cfg, groups, seed, core_attention=SliceCoreAttention)

    def run(batch):
        out = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        return loss_func(batch["loss_mask"], out)

    return microbatch_mean_step(run, batches), global_grads(model)


def per_document_step(model_cfg, groups, packs, seed: int):
    """Each pack ``{"tokens", "labels", "loss_mask"}`` (1-D) cut into its documents ``pack["lengths"]``,
    every document through the whole model on its own with positions from 0 and plain causal
    attention; the loss is the mean over packs of each pack's masked-token mean. Returns (the
    token-weighted mean loss over all packs, grads)."""
    from megatron_slim.megatron.model.gpt import global_grads

    model = whole_model(model_cfg, groups, seed)
    total, summed, tokens = 0.0, 0.0, 0.0
    for pack in packs:
        pack_sum, offset = 0.0, 0
        for s in pack["lengths"]:
            part = slice(offset, offset + s)
            losses = model(
                pack["tokens"][part].unsqueeze(0),
                torch.arange(s).unsqueeze(0),
                None,
                labels=pack["labels"][part].unsqueeze(0),
            )
            pack_sum = pack_sum + (losses.reshape(-1) * pack["loss_mask"][part]).sum()
            offset += s
        total = total + pack_sum / pack["loss_mask"].sum() / len(packs)
        summed, tokens = summed + pack_sum.detach(), tokens + pack["loss_mask"].sum()
    total.backward()
    return summed / tokens, global_grads(model)
