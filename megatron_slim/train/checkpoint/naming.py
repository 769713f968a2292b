"""A rank's training state as a flat ``{key: tensor}`` dict keyed by whole-model names.

Model weights are ``model/<global name>`` (``megatron_slim.megatron.model.weights.global_name``: layers
by their global index), optimizer moments ``optim/<global name>/<field>`` (``exp_avg``,
``exp_avg_sq``, ``step``). No key depends on the pipeline or data-parallel split, so a checkpoint
written at pp4 loads at pp2: each rank asks ``torch.distributed.checkpoint`` for the names it
holds. Replicas (data-parallel ranks, the two copies of a tied embedding, both named
``embedding.word_embeddings.weight``) save the same key; DCP writes it once and loads it into
every holder. A tensor-parallel shard carries its shard in the key (``|tp1of2``): the checkpoint
keeps the tensor-parallel size.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from megatron_slim.megatron.model.weights import global_named_parameters

MODEL, OPTIM = "model/", "optim/"


def _key(name: str, param: torch.nn.Parameter, chunk) -> str:
    info = chunk.slim_chunk_info
    if info.tp_size > 1 and getattr(param, "tensor_model_parallel", False):
        return f"{name}|tp{info.tp_rank}of{info.tp_size}"
    return name


def named_parameters(chunks) -> dict[str, list[torch.nn.Parameter]]:
    """``{key: [parameters]}`` over this rank's chunks (two entries for a tied embedding whose
    both ends live on this rank in different virtual chunks)."""
    named: dict[str, list[torch.nn.Parameter]] = defaultdict(list)
    for chunk in chunks:
        for name, param in global_named_parameters(chunk).items():
            named[_key(name, param, chunk)].append(param)
    return dict(named)


def training_state(chunks, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """What this rank saves: its weights and their optimizer state under whole-model keys."""
    state = {}
    for key, params in named_parameters(chunks).items():
        state[MODEL + key] = params[0].detach()
        for field, value in optimizer.state.get(params[0], {}).items():
            state[f"{OPTIM}{key}/{field}"] = value.detach() if torch.is_tensor(value) else torch.tensor(value)
    return state


def placeholders(chunks, saved_keys: dict) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Tensors for ``torch.distributed.checkpoint.load`` to fill for this rank (weights in place),
    and the model keys this rank needs that the checkpoint lacks. ``saved_keys`` maps a saved key
    to its metadata (DCP's ``state_dict_metadata``)."""
    wanted, missing = {}, []
    optim_fields = defaultdict(list)
    for saved in saved_keys:
        if saved.startswith(OPTIM):
            key, _, field = saved[len(OPTIM) :].rpartition("/")
            optim_fields[key].append(field)
    for key, params in named_parameters(chunks).items():
        if MODEL + key not in saved_keys:
            missing.append(key)
            continue
        wanted[MODEL + key] = params[0].data
        for field in optim_fields.get(key, []):
            meta = saved_keys[f"{OPTIM}{key}/{field}"]
            wanted[f"{OPTIM}{key}/{field}"] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
    return wanted, missing


def apply(chunks, optimizer: torch.optim.Optimizer, loaded: dict[str, torch.Tensor]) -> None:
    """Copy the loaded weights into every copy and install the optimizer state."""
    optim_state: dict[str, dict] = defaultdict(dict)
    for saved, value in loaded.items():
        if saved.startswith(OPTIM):
            key, _, field = saved[len(OPTIM) :].rpartition("/")
            optim_state[key][field] = value
    for key, params in named_parameters(chunks).items():
        with torch.no_grad():
            for other in params[1:]:
                other.copy_(params[0])
        if key in optim_state:
            for param in params:
                optimizer.state[param] = {field: value.clone() for field, value in optim_state[key].items()}
