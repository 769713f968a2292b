"""Rank functions for the dynmo model tests (spawned by run_ranks; megatron is imported inside them)."""

from __future__ import annotations

import torch

from megatron_slim.plan.recipe import ModelConfig, TrainConfig
from tests.oracle.models import TINY_GQA_4L

FROZEN = frozenset({0, 2})  # not a prefix: the gradient still has to flow through layer 0..2
STEPS = 3


def _batch(cfg: ModelConfig, seed: int, batch: int = 2):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, cfg.vocab_size, (batch, cfg.seq_length), generator=g) for _ in range(2)]


def _model(cfg, groups, seed, **layers):
    from tests.oracle.reference import whole_model

    return whole_model(cfg, groups, seed, **layers)


def _train_steps(chunk, steps, freeze_at, freeze, seed):
    """``steps`` AdamW steps on one batch; ``freeze(chunk, iteration)`` before each step from ``freeze_at``."""
    from megatron_slim.megatron.model.optimizer import build_optimizer

    optimizer, _ = build_optimizer([chunk], TrainConfig(global_batch_size=1, lr=1e-2, weight_decay=0.1))
    ids, labels = _batch(ModelConfig(**TINY_GQA_4L), seed)
    for it in range(1, steps + 1):
        if it >= freeze_at:
            freeze(chunk, it)
        optimizer.zero_grad(set_to_none=True)
        chunk(ids, None, None, labels=labels).mean().backward()
        optimizer.step()
    return optimizer


def freezing(rank, world_size, seed):
    """The dynmo freeze schedule ("2:0,2:2") against layers frozen by hand from step 2, and a run
    without freezing; whole-model states after each."""
    from megatron_slim.megatron.model.gpt import global_state_dict
    from megatron_slim.megatron.model.parallel import model_parallel
    from megatron_slim.plan.dynmo.options import frozen_layers, parse_freeze
    from megatron_slim.train.dynmo.freeze import set_frozen

    cfg = ModelConfig(**TINY_GQA_4L)
    steps = parse_freeze("2:0,2:2", cfg.num_layers)

    def by_schedule(chunk, it):
        set_frozen([chunk], frozen_layers(steps, it))

    def by_hand(chunk, it):
        for i, layer in enumerate(chunk.decoder.layers):
            if i in FROZEN:
                for p in layer.parameters():
                    p.requires_grad = False
                    p.grad = None

    out = {}
    with model_parallel(seed=seed) as groups:
        for name, freeze in (("schedule", by_schedule), ("hand", by_hand), ("none", lambda c, i: None)):
            chunk = _model(cfg, groups, seed)
            out.setdefault("initial", global_state_dict(chunk))
            optimizer = _train_steps(chunk, STEPS, 2, freeze, seed)
            out[name] = global_state_dict(chunk)
            out[name + "_trainable"] = [n for n, p in chunk.named_parameters() if p.requires_grad]
            out[name + "_state_count"] = len(optimizer.state)
    return out


def early_exit(rank, world_size, seed):
    """The early-exit layer against the rule applied to stock layers (``reference_exit_forward``):
    losses, gradients and each layer's share of active tokens."""
    from megatron_slim.megatron.model.early_exit import (
        EarlyExitTransformerLayer,
        ExitRule,
        attach_exit_rule,
        reference_exit_forward,
        token_confidence,
    )
    from megatron_slim.megatron.model.gpt import global_grads
    from megatron_slim.megatron.model.parallel import model_parallel

    cfg = ModelConfig(**TINY_GQA_4L)
    ids, labels = _batch(cfg, seed)
    with model_parallel(seed=seed) as groups:
        probe, inputs = _model(cfg, groups, seed), {}

        def record(module, args, kwargs):
            inputs.setdefault(module.layer_number - 1, kwargs["hidden_states"].detach())

        for layer in probe.decoder.layers:
            layer.register_forward_pre_hook(record, with_kwargs=True)
        probe(ids, None, None, labels=labels)
        # half the tokens entering layer 2 are confident: both kinds are exercised from there on
        rule = ExitRule(float(token_confidence(inputs[2]).median()), from_layer=2)
        fast = _model(cfg, groups, seed, transformer_layer=EarlyExitTransformerLayer)
        counts: list = []
        attach_exit_rule([fast], rule, counts)
        reference = _model(cfg, groups, seed)
        for layer in reference.decoder.layers:
            layer.forward = lambda *a, _layer=layer, **k: reference_exit_forward(_layer, rule, *a, **k)
        out = {"counts": counts, "threshold": rule.threshold}
        for name, chunk in (("fast", fast), ("reference", reference), ("no_exit", probe)):
            chunk.zero_grad(set_to_none=True)
            losses = chunk(ids, None, None, labels=labels)
            losses.mean().backward()
            out[name] = {"losses": losses.detach(), "grads": global_grads(chunk)}
    return out


PROFILED = dict(TINY_GQA_4L, hidden_size=256, ffn_hidden_size=1024, seq_length=256)
ROUNDS = 5


def profiling(rank, world_size, seed):
    """``ROUNDS`` profiled iterations with every layer training, then as many with ``FROZEN`` frozen;
    each iteration's profile, and the bytes an outer saved-tensor hook saw in the last forward."""
    from megatron_slim.megatron.model.optimizer import build_optimizer
    from megatron_slim.megatron.model.parallel import model_parallel
    from megatron_slim.train.dynmo.freeze import set_frozen
    from megatron_slim.train.dynmo.profile import LayerProfiler

    cfg = ModelConfig(**PROFILED)
    ids, labels = _batch(cfg, seed, batch=4)
    out: dict = {"rounds": []}
    with model_parallel(seed=seed) as groups:
        chunk = _model(cfg, groups, seed)
        optimizer, _ = build_optimizer([chunk], TrainConfig(global_batch_size=1))
        profiler = LayerProfiler([chunk], optimizer, num_microbatches=2, smoothing=1.0)
        statics = {p.untyped_storage().data_ptr() for p in chunk.parameters()}
        for it in range(2 * ROUNDS):
            if it == ROUNDS:
                set_frozen([chunk], FROZEN)
            optimizer.zero_grad(set_to_none=True)
            seen: dict = {}
            with torch.autograd.graph.saved_tensors_hooks(_outer_pack(seen, statics), lambda t: t):
                losses = [chunk(ids, None, None, labels=labels) for _ in range(2)]  # two microbatches
            for loss in losses:  # one backward after the other, as a pipeline runs them
                loss.mean().backward()
            optimizer.step()
            out["rounds"].append(profiler.finish())
            out["outer_bytes"] = sum(seen.values()) / 2
        out["whole_model"] = profiler.whole_model
        with torch.no_grad():  # an evaluation forward: not profiled
            chunk(ids, None, None, labels=labels)
        out["no_grad"] = profiler.finish()
    return out


def _outer_pack(seen: dict, statics: set):
    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in statics:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    return pack
