"""Whole-model parameter names for model chunks, and weights moved by those names.

A chunk (one pipeline stage / virtual chunk, one tensor-parallel shard) names its parameters
locally: ``decoder.layers.0...`` is its *first* layer. Here every parameter gets its name in the
unpipelined model instead (``decoder.layers.<global index>...``), using each layer's
``layer_number`` (1-based, global). With tied embeddings, a last-stage chunk that does not hold
the embedding keeps its own copy of the output weight; it is named
``embedding.word_embeddings.weight`` like the embedding it mirrors, so both copies get the same
initial values and their gradients can be matched (and must be summed by the runtime).

Tensor-parallel shards are cut from the full tensor using megatron's own parameter metadata
(``partition_dim``, ``partition_stride``), so a fused SwiGLU ``linear_fc1`` (stride 2:
``[gate_r; up_r]`` on rank r) comes out right.
"""

from __future__ import annotations

import math
import re
import zlib
from typing import Mapping

import torch

_LAYER_PREFIX = re.compile(r"^decoder\.layers\.(\d+)\.")
TIED_OUTPUT = "output_layer.weight"
TIED_EMBEDDING = "embedding.word_embeddings.weight"
# Parameters whose output feeds the residual stream get std / sqrt(2 * num_layers) (GPT-2 style).
_RESIDUAL_OUTPUTS = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")


def _chunk_info(chunk):
    info = getattr(chunk, "slim_chunk_info", None)
    if info is None:
        raise ValueError("chunk: expected a model built by megatron_slim.megatron.model.gpt.build_chunk")
    return info


def global_name(chunk, local_name: str) -> str:
    """The whole-model name of ``chunk``'s parameter ``local_name``."""
    match = _LAYER_PREFIX.match(local_name)
    if match:
        layer = chunk.decoder.layers[int(match.group(1))]
        return f"decoder.layers.{layer.layer_number - 1}." + local_name[match.end() :]
    if local_name == TIED_OUTPUT and _chunk_info(chunk).tied_embeddings:
        return TIED_EMBEDDING
    return local_name


def global_named_parameters(chunk) -> dict[str, torch.nn.Parameter]:
    """``{whole-model name: parameter}`` for every parameter of ``chunk`` (TP shards as held)."""
    named: dict[str, torch.nn.Parameter] = {}
    for local_name, param in chunk.named_parameters():
        name = global_name(chunk, local_name)
        if name in named:
            raise RuntimeError(f"two parameters of one chunk map to {name!r}")
        named[name] = param
    return named


def global_state_dict(chunk) -> dict[str, torch.Tensor]:
    """Detached copies of ``chunk``'s parameters under whole-model names."""
    return {name: p.detach().clone() for name, p in global_named_parameters(chunk).items()}


def global_grads(chunk) -> dict[str, torch.Tensor | None]:
    """``{whole-model name: grad}`` (``None`` for parameters without a gradient)."""
    return {
        name: (None if p.grad is None else p.grad.detach().clone())
        for name, p in global_named_parameters(chunk).items()
    }


def tp_shard(full: torch.Tensor, param: torch.nn.Parameter, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's shard of ``full`` for ``param`` (megatron's strided split along its
    ``partition_dim``); replicated parameters get ``full`` itself."""
    if tp_size == 1 or not getattr(param, "tensor_model_parallel", False):
        return full
    dim = param.partition_dim  # type: ignore[attr-defined]  # set by megatron on TP parameters
    stride = getattr(param, "partition_stride", 1)
    pieces = torch.chunk(full, stride * tp_size, dim=dim)
    return torch.cat(pieces[tp_rank::tp_size], dim=dim)


def full_shape(param: torch.nn.Parameter, tp_size: int) -> tuple[int, ...]:
    shape = list(param.shape)
    if tp_size > 1 and getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= tp_size  # type: ignore[attr-defined]  # set by megatron on TP parameters
    return tuple(shape)


def load_global_state_dict(chunk, full_state_dict: Mapping[str, torch.Tensor], *, strict: bool = True) -> None:
    """Copy a whole (unsharded, unpipelined) model's weights into ``chunk`` by whole-model name.

    With ``strict``, every parameter of ``chunk`` must be found with the full shape.
    """
    info = _chunk_info(chunk)
    with torch.no_grad():
        for name, param in global_named_parameters(chunk).items():
            if name not in full_state_dict:
                if strict:
                    raise KeyError(f"full_state_dict has no {name!r}")
                continue
            full = full_state_dict[name]
            expected = full_shape(param, info.tp_size)
            if tuple(full.shape) != expected:
                raise ValueError(f"full_state_dict[{name!r}] has shape {tuple(full.shape)}; allowed: {expected}")
            param.copy_(tp_shard(full.to(param.dtype), param, info.tp_rank, info.tp_size))


def _seed_for(seed: int, name: str) -> int:
    return zlib.crc32(f"{seed}/{name}".encode())


def init_full_tensor(
    name: str, shape: tuple[int, ...], *, seed: int, num_layers: int, std: float = 0.02
) -> torch.Tensor:
    """The whole-model initial value of parameter ``name``: a function of (seed, name) only, so
    any pipeline/tensor split of the model starts from the same weights."""
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    if name.endswith(_RESIDUAL_OUTPUTS):
        std = std / math.sqrt(2.0 * num_layers)
    generator = torch.Generator().manual_seed(_seed_for(seed, name))
    return torch.randn(shape, generator=generator) * std


def init_chunk_weights(chunk, *, seed: int, std: float = 0.02) -> None:
    """(Re)initialise every parameter of ``chunk`` from :func:`init_full_tensor`."""
    info = _chunk_info(chunk)
    with torch.no_grad():
        for name, param in global_named_parameters(chunk).items():
            full = init_full_tensor(
                name, full_shape(param, info.tp_size), seed=seed, num_layers=info.num_layers, std=std
            )
            param.copy_(tp_shard(full, param, info.tp_rank, info.tp_size).to(param.dtype))
