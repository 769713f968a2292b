"""A Megatron-Bridge ``ConfigContainer`` seen as the Megatron-LM flags it stands for, and the checks
SlimPipe needs before it runs under Bridge's loop (``bridge.py`` installs it).

``bridge_args`` maps the config (``config.model``: a ``GPTModelProvider`` or ``GPTModelConfig``,
whose fields are megatron-core ``TransformerConfig`` names; ``config.train``; ``config.dataset``) and
the explicit SlimPipe settings onto Megatron-LM's argument names, so the launcher's own
``check_megatron_args`` and slice planner apply unchanged; its messages are given back in Bridge's
field names. ``_refuse_bridge_only`` covers what only Bridge has: settings under which Bridge would
bypass the schedule it asked for, or undo the layer spec.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Optional

from megatron_slim.megatron.launch.flags import ATTENTION_BACKENDS, SLICE_POLICIES, check_megatron_args
from megatron_slim.plan.schema import ConfigError

GPT_MODEL_TYPES = ("GPTModelProvider", "GPTModelConfig")
# Megatron-LM flag -> the Bridge field or install() argument it stands for, for error messages
FIELD_NAMES = {
    "--use-slimpipe": "SlimPipe (megatron_slim.megatron.bridge.install)",
    "--slimpipe-num-slices": "install(num_slices=...)",
    "--slimpipe-slice-policy": "install(slice_policy=...)",
    "--slimpipe-vocab-parallel": "install(vocab_parallel=True)",
    "--seq-length": "model.seq_length",
    "--num-experts": "model.num_moe_experts",
    "--context-parallel-size": "model.context_parallel_size",
    "--sequence-parallel": "model.sequence_parallel",
    "--hierarchical-context-parallel-sizes": "model.hierarchical_context_parallel_sizes",
    "--cp-comm-type": "model.cp_comm_type",
    "--multi-latent-attention": "model.multi_latent_attention",
    "--cuda-graph-impl": "model.cuda_graph_impl",
    "--enable-cuda-graph": "model.enable_cuda_graph",
    "--position-embedding-type": "model.position_embedding_type",
    "--reset-attention-mask": "dataset.reset_attention_mask",
    "--hybrid-context-parallel": "model.hybrid_context_parallel",
    "--num-microbatches-with-partial-activation-checkpoints": (
        "model.num_microbatches_with_partial_activation_checkpoints"
    ),
}


def _model_field(model: Any, name: str, default: Any = None) -> Any:
    value = getattr(model, name, default)
    return default if value is None else value


@dataclass(frozen=True)
class SlimPipeOptions:
    """The SlimPipe settings ``install()`` takes, as one value."""

    num_slices: int
    slice_policy: str
    hardware: str
    calibration: Optional[str]
    attention_backend: str
    vocab_parallel: bool = False

    def flags(self) -> dict[str, Any]:
        """The Megatron-LM arguments these settings stand for."""
        return dict(
            use_slimpipe=True,
            slimpipe_num_slices=self.num_slices,
            slimpipe_slice_policy=self.slice_policy,
            slimpipe_vocab_parallel=self.vocab_parallel,
            slimpipe_hardware=self.hardware,
            slimpipe_calibration=self.calibration,
            cp_engine="te",
            cp_remap=False,
            megatron_slim_attention_backend=self.attention_backend,
            rank=0,
        )


def bridge_args(config: Any, slimpipe: SlimPipeOptions) -> argparse.Namespace:
    """The Megatron-LM argument namespace a Bridge ``ConfigContainer`` stands for, with megatron-slim's
    SlimPipe flags set: what the launcher's checks and slice planner read."""
    import torch

    m, train, dataset = config.model, config.train, getattr(config, "dataset", None)
    heads = m.num_attention_heads
    groups = _model_field(m, "num_query_groups", heads)
    dtype = getattr(m, "params_dtype", None)
    return argparse.Namespace(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=getattr(m, "ffn_hidden_size", None),
        num_attention_heads=heads,
        num_query_groups=groups,
        group_query_attention=groups != heads,
        seq_length=m.seq_length,
        rotary_base=_model_field(m, "rotary_base", 10000),
        vocab_size=getattr(m, "vocab_size", None),
        padded_vocab_size=None,
        tensor_model_parallel_size=_model_field(m, "tensor_model_parallel_size", 1),
        pipeline_model_parallel_size=_model_field(m, "pipeline_model_parallel_size", 1),
        virtual_pipeline_model_parallel_size=getattr(m, "virtual_pipeline_model_parallel_size", None),
        context_parallel_size=_model_field(m, "context_parallel_size", 1),
        data_parallel_size=None,
        sequence_parallel=bool(getattr(m, "sequence_parallel", False)),
        hierarchical_context_parallel_sizes=getattr(m, "hierarchical_context_parallel_sizes", None),
        cp_comm_type=getattr(m, "cp_comm_type", None),
        hybrid_context_parallel=bool(getattr(m, "hybrid_context_parallel", False)),
        num_microbatches_with_partial_activation_checkpoints=getattr(
            m, "num_microbatches_with_partial_activation_checkpoints", None
        ),
        num_experts=getattr(m, "num_moe_experts", None),
        multi_latent_attention=bool(getattr(m, "multi_latent_attention", False)),
        cuda_graph_impl=getattr(m, "cuda_graph_impl", None),
        enable_cuda_graph=bool(getattr(m, "enable_cuda_graph", False)),
        mtp_num_layers=getattr(m, "mtp_num_layers", None),
        position_embedding_type=getattr(m, "position_embedding_type", None),
        reset_attention_mask=bool(getattr(dataset, "reset_attention_mask", False)),
        bf16=bool(getattr(m, "bf16", False)) or dtype == torch.bfloat16,
        fp16=bool(getattr(m, "fp16", False)),
        recompute_granularity=getattr(m, "recompute_granularity", None),
        micro_batch_size=train.micro_batch_size,
        global_batch_size=getattr(train, "global_batch_size", None),
        **slimpipe.flags(),
    )


def _in_bridge_terms(message: str) -> str:
    for flag in sorted(FIELD_NAMES, key=len, reverse=True):
        message = message.replace(flag, FIELD_NAMES[flag])
    return f"Megatron-Bridge config: {message}"


def _refuse_bridge_only(config: Any) -> None:
    """What Bridge has and Megatron-LM's flags do not: each would bypass or undo SlimPipe."""
    model, dataset = config.model, getattr(config, "dataset", None)
    kinds = [cls.__name__ for cls in type(model).__mro__]
    if not any(kind in GPT_MODEL_TYPES for kind in kinds) or not hasattr(model, "transformer_layer_spec"):
        raise ConfigError(
            f"config.model: {type(model).__name__} is not supported by SlimPipe under Megatron-Bridge; "
            f"allowed: a GPTModelProvider (or subclass, e.g. LlamaModelProvider) or GPTModelConfig"
        )
    backend = getattr(model, "attention_backend", None)
    if str(getattr(backend, "name", backend)).lower().endswith("local"):
        raise ConfigError(
            f"model.attention_backend: got {backend}; Bridge replaces the core attention with "
            "DotProductAttention for 'local', which would drop SlimPipe's; allowed: any other "
            "backend (SlimPipe's kernels are chosen by install(attention_backend=...))"
        )
    if getattr(model, "use_transformer_engine_full_layer_spec", False):
        raise ConfigError(
            "model.use_transformer_engine_full_layer_spec: got True; the full-TE layer has no core "
            "attention slot for SlimPipe; allowed: False"
        )
    if getattr(getattr(model, "dist_train", None), "use_dist_train", False):
        raise ConfigError(
            "model.dist_train.use_dist_train: got True; Bridge then calls its own 1F1B schedule "
            "directly, bypassing SlimPipe; allowed: False"
        )
    loader = getattr(dataset, "dataloader_type", None)
    if loader == "batch":
        raise ConfigError(
            "dataset.dataloader_type: got 'batch'; its batches change the sequence length every "
            "step, and SlimPipe's slice plan covers model.seq_length; allowed: 'single', 'cyclic', "
            "'external'"
        )
    for name in ("packed_sequence_specs", "offline_packing_specs", "enable_offline_packing", "enable_in_batch_packing"):
        if getattr(dataset, name, None):
            raise ConfigError(
                f"dataset.{name}: got {getattr(dataset, name)!r}; SlimPipe does not support packed "
                "(THD) sequences yet; allowed: None/False"
            )


def check_config(config: Any, slimpipe: SlimPipeOptions) -> argparse.Namespace:
    """Refuse a config SlimPipe cannot run under Bridge; return its Megatron-LM argument namespace."""
    policy, backend = slimpipe.slice_policy, slimpipe.attention_backend
    if policy not in SLICE_POLICIES:
        raise ConfigError(f"slice_policy: got {policy!r}; allowed: {', '.join(SLICE_POLICIES)}")
    if policy == "exchange":
        raise ConfigError(
            "slice_policy: got 'exchange'; context exchange runs under megatron-slim train and Megatron-LM's "
            "launcher, not yet under Megatron-Bridge; allowed: uniform, balanced"
        )
    if backend not in ATTENTION_BACKENDS:
        raise ConfigError(f"attention_backend: got {backend!r}; allowed: {', '.join(ATTENTION_BACKENDS)}")
    num_slices = slimpipe.num_slices
    if not isinstance(num_slices, int) or isinstance(num_slices, bool):
        raise ConfigError(f"num_slices: got {num_slices!r}; allowed: an integer >= 1")
    if not isinstance(slimpipe.vocab_parallel, bool):
        raise ConfigError(f"vocab_parallel: got {slimpipe.vocab_parallel!r}; allowed: True, False")
    if slimpipe.vocab_parallel:
        raise ConfigError(
            "install(vocab_parallel=True): vocab_parallel runs in megatron-slim train only and under Megatron-LM's "
            "launcher (python -m megatron_slim.launch), not under Megatron-Bridge "
            "yet; allowed: vocab_parallel=False"
        )
    _refuse_bridge_only(config)
    args = bridge_args(config, slimpipe)
    try:
        check_megatron_args(args)
    except ConfigError as exc:
        raise ConfigError(_in_bridge_terms(str(exc))) from None
    return args
