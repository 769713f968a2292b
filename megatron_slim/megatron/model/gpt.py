"""Llama-style megatron-core ``GPTModel`` chunks, built on CPU from a :class:`ModelConfig`.

A *chunk* holds a contiguous range of the model's layers (one pipeline stage, or one virtual
chunk of an interleaved stage), plus the embedding (``pre_process``) and/or the final norm and
output layer (``post_process``). Architecture: RoPE, RMSNorm, SwiGLU, grouped-query attention,
no biases, no dropout, fp32.

Layer numbering. megatron adds a pipeline offset to each layer's number, computed from the
pipeline rank, ``config.pipeline_model_parallel_size`` and the vp stage; it assumes an even split
and (before 0.15) reads ``parallel_state``. A chunk here is instead built as a standalone model
(its ``TransformerConfig`` says ``pipeline_model_parallel_size=1``, so megatron's offset is 0)
holding exactly ``len(layers)`` layers, and each layer is given its global number by construction
(``layer_number = local + layers.start``). Any contiguous range works, including the uneven
splits a rebalancer produces. This also keeps megatron's tied-embedding set-up for pipelined
models (``weight.data.cuda()`` plus an all-reduce) out of CPU runs.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_slim.megatron import compat
from megatron_slim.megatron.model.core_attention import SlimCoreAttention
from megatron_slim.megatron.model.layer_specs import with_core_attention
from megatron_slim.megatron.model.parallel import ParallelGroups
from megatron_slim.megatron.model.rotary import make_cpu_rotary_embedding
from megatron_slim.megatron.model.weights import init_chunk_weights
from megatron_slim.plan.recipe import ModelConfig

INIT_STD = 0.02


@dataclass(frozen=True)
class ChunkInfo:
    """What a chunk holds; attached to it as ``chunk.slim_chunk_info``."""

    layers: range
    pre_process: bool
    post_process: bool
    num_layers: int
    tied_embeddings: bool
    tp_rank: int = 0
    tp_size: int = 1


def stage_layers(num_layers: int, pp: int, vpp: int = 1) -> list[list[range]]:
    """Megatron's interleaved layer assignment: ``result[rank][chunk]`` is the global layer range
    of pipeline stage ``chunk * pp + rank`` (each of the ``pp * vpp`` stages holds
    ``num_layers / (pp * vpp)`` consecutive layers)."""
    for name, value in (("num_layers", num_layers), ("pp", pp), ("vpp", vpp)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: allowed values are integers >= 1")
    stages = pp * vpp
    if num_layers % stages:
        raise ValueError(f"num_layers={num_layers}: allowed values are multiples of pp*vpp={stages}")
    per_stage = num_layers // stages
    return [[range((c * pp + r) * per_stage, (c * pp + r + 1) * per_stage) for c in range(vpp)] for r in range(pp)]


def chunk_roles(pp_rank: int, chunk: int, pp: int, vpp: int = 1) -> tuple[bool, bool]:
    """``(pre_process, post_process)`` of virtual chunk ``chunk`` on pipeline rank ``pp_rank``."""
    return (pp_rank == 0 and chunk == 0, pp_rank == pp - 1 and chunk == vpp - 1)


def transformer_config(model: ModelConfig, *, tp: int = 1, cp: int = 1, **overrides) -> TransformerConfig:
    """megatron's ``TransformerConfig`` for a Llama-style chunk of ``model`` (see module doc for
    why it says ``pipeline_model_parallel_size=1``). ``overrides`` are further config fields."""
    fields = dict(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=model.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=INIT_STD,
        tensor_model_parallel_size=tp,
        context_parallel_size=cp,
        pipeline_model_parallel_size=1,
        sequence_parallel=False,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        perform_initialization=True,  # also sets the TP metadata (partition_dim/stride) we rely on
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
    )
    fields.update(compat.without_deprecated_defaults(TransformerConfig))
    fields.update(overrides)
    known = compat.transformer_config_fields()
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"overrides: unknown TransformerConfig fields {unknown}")
    return TransformerConfig(**{k: v for k, v in fields.items() if k in known})


class _GlobalLayerNumber:
    """Mixin: shift the (local, 1-based) ``layer_number`` megatron passes by ``layer_offset``."""

    def __init__(self, *args, layer_offset: int = 0, layer_number: int = 1, **kwargs):
        super().__init__(*args, layer_number=layer_number + layer_offset, **kwargs)  # type: ignore[call-arg]  # mixin


@functools.cache
def _globally_numbered(layer_cls: type) -> type:
    return type(
        layer_cls.__name__,
        (_GlobalLayerNumber, layer_cls),
        {"__module__": layer_cls.__module__, "__qualname__": layer_cls.__qualname__},
    )


def layer_spec(
    core_attention: type = SlimCoreAttention,
    transformer_layer: Optional[type] = None,
    *,
    layer_offset: int = 0,
    mlp: Optional[ModuleSpec] = None,
) -> ModuleSpec:
    """Spec of one Llama layer: megatron's local layer with ``core_attention`` plugged in, built
    as ``transformer_layer`` (default ``TransformerLayer``) numbered from ``layer_offset + 1``;
    ``mlp`` replaces the dense MLP's spec (``megatron.model.moe.moe_mlp_spec``)."""
    layer_cls = transformer_layer or TransformerLayer
    if not (isinstance(layer_cls, type) and issubclass(layer_cls, TransformerLayer)):
        raise ValueError(
            f"transformer_layer={layer_cls!r}: allowed values are subclasses of "
            "megatron.core.transformer.transformer_layer.TransformerLayer"
        )
    submodules = compat.local_layer_submodules("RMSNorm")
    if mlp is not None:
        submodules = dataclasses.replace(submodules, mlp=mlp)
    spec = ModuleSpec(
        module=_globally_numbered(layer_cls),
        submodules=submodules,
        params={"layer_offset": layer_offset},
    )
    return with_core_attention(spec, core_attention, flag="layer_spec(core_attention=...)")


def _check_layers(layers: range, num_layers: int) -> None:
    if not isinstance(layers, range) or layers.step != 1:
        raise ValueError(f"layers={layers!r}: allowed values are ranges with step 1")
    if not 0 <= layers.start <= layers.stop <= num_layers:
        raise ValueError(f"layers={layers!r}: allowed values lie within range(0, {num_layers})")


def build_chunk(
    model: ModelConfig,
    groups: ParallelGroups,
    *,
    layers: range,
    pre_process: bool,
    post_process: bool,
    core_attention: type = SlimCoreAttention,
    transformer_layer: Optional[type] = None,
    mlp: Optional[ModuleSpec] = None,
    seed: int = 1234,
    **config_overrides,
) -> GPTModel:
    """Build the chunk of ``model`` holding global ``layers`` on CPU, initialised by ``seed``.

    Tensor- and context-parallel sizes come from ``groups``. Initial weights depend only on
    ``(seed, whole-model parameter name)``, so every split of the model starts identical to the
    unsplit model built with the same seed.
    """
    _check_layers(layers, model.num_layers)
    config = transformer_config(model, tp=groups.tp_size, cp=groups.cp_size, **config_overrides)
    block = TransformerBlockSubmodules(
        layer_specs=[layer_spec(core_attention, transformer_layer, layer_offset=layers.start, mlp=mlp)] * len(layers),
        layer_norm=compat.local_layer_submodules("RMSNorm").input_layernorm,
    )
    tied = not model.untie_embeddings_and_output_weights
    chunk = GPTModel(
        config=config,
        transformer_layer_spec=block,
        vocab_size=model.vocab_size,
        max_sequence_length=model.seq_length,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=tied,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=model.rotary_base,
        **compat.model_groups_kwargs(GPTModel, groups),
    )
    chunk.rotary_pos_emb = make_cpu_rotary_embedding(
        kv_channels=model.head_dim,
        rotary_percent=1.0,
        rotary_base=model.rotary_base,
        use_cpu_initialization=True,
        cp_group=groups.cp,
    )
    chunk.slim_chunk_info = ChunkInfo(
        layers=layers,
        pre_process=pre_process,
        post_process=post_process,
        num_layers=model.num_layers,
        tied_embeddings=tied,
        tp_rank=groups.tp_rank,
        tp_size=groups.tp_size,
    )
    init_chunk_weights(chunk, seed=seed, std=config.init_method_std)
    if tied and post_process and not pre_process:
        # the last stage's copy of the first stage's embedding: megatron's mark for "count once"
        chunk.output_layer.weight.shared = True
    return chunk


def split_layers(num_layers: int, layers_per_stage: Sequence[int]) -> list[list[range]]:
    """``stage_layers``'s shape for an uneven split without virtual chunks: ``result[rank][0]`` holds
    ``layers_per_stage[rank]`` consecutive layers."""
    if sum(layers_per_stage) != num_layers or min(layers_per_stage, default=0) < 1:
        raise ValueError(
            f"layers_per_stage={list(layers_per_stage)}: allowed values are counts >= 1 summing to {num_layers}"
        )
    ends = list(itertools.accumulate(layers_per_stage))
    return [[range(end - n, end)] for n, end in zip(layers_per_stage, ends)]


def build_rank_chunks(
    model: ModelConfig, groups: ParallelGroups, layers_per_stage: Sequence[int] = (), **kwargs
) -> list[GPTModel]:
    """All virtual chunks of this pipeline rank (``groups.vpp`` of them), in chunk order; with
    ``layers_per_stage`` (one count per pipeline rank, vpp 1) that split instead of the even one."""
    pp, vpp = groups.pp_size, groups.vpp
    if layers_per_stage and (vpp != 1 or len(layers_per_stage) != pp):
        raise ValueError(
            f"layers_per_stage={list(layers_per_stage)}: allowed values are {pp} counts (one per pipeline "
            f"rank) with vpp=1 (now vpp={vpp})"
        )
    split = split_layers(model.num_layers, layers_per_stage) if layers_per_stage else None
    ranges = (split or stage_layers(model.num_layers, pp, vpp))[groups.pp_rank]
    chunks = []
    for c, layers in enumerate(ranges):
        pre, post = chunk_roles(groups.pp_rank, c, pp, vpp)
        chunks.append(build_chunk(model, groups, layers=layers, pre_process=pre, post_process=post, **kwargs))
        chunks[-1].slim_build_kwargs = dict(kwargs)  # a live migration rebuilds the rank's chunks alike
    return chunks


def decoder_layers(chunks) -> list[TransformerLayer]:
    """The decoder layers of ``chunks`` in order; ``layer.layer_number - 1`` is a layer's global index."""
    return [layer for chunk in chunks for layer in chunk.decoder.layers]


# Whole-model naming lives in weights.py; re-exported here because callers think in chunks.
from megatron_slim.megatron.model.weights import (  # noqa: E402
    global_grads,
    global_named_parameters,
    global_state_dict,
    load_global_state_dict,
)

__all__ = [
    "ChunkInfo",
    "build_chunk",
    "build_rank_chunks",
    "chunk_roles",
    "decoder_layers",
    "global_grads",
    "global_named_parameters",
    "global_state_dict",
    "layer_spec",
    "load_global_state_dict",
    "split_layers",
    "stage_layers",
    "transformer_config",
]
