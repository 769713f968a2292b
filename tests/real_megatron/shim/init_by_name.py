"""Initial weights that depend on each parameter's global name only (test harness only).

Megatron seeds pipeline rank ``r`` with ``seed + 100 * r``, so the same model split over 2 or 4
pipeline stages starts from different weights and their losses cannot be compared. With
``MEGATRON_SLIM_TEST_INIT_BY_NAME=1``, ``install`` wraps ``get_model`` in
``megatron.training.training``, and ``install_builder`` the model builder that Megatron-LM's
``pretrain_gpt.py`` calls instead from core_v0.19 (``megatron.training.models.gpt``): right after
the model is built (before the optimizer copies anything) every parameter that is not constant
is redrawn from N(0, 0.02) with a generator seeded by a CRC of its global name (decoder layers by
their global layer number); norms' ones and biases' zeros stay. A tensor-parallel parameter is
drawn whole and cut to this TP rank's shard (megatron's strided split, ``model.weights.tp_shard``).
Any pipeline and tensor-parallel split then starts from the same weights.
"""

from __future__ import annotations

import functools
import zlib

import torch


def _global_names(chunk) -> dict:
    from megatron.core.transformer.transformer_layer import TransformerLayer

    names: dict = {}
    for module in chunk.modules():
        if isinstance(module, TransformerLayer):
            for name, p in module.named_parameters():
                names[id(p)] = f"layer{module.layer_number - 1}.{name}"
    for name, p in chunk.named_parameters():
        if id(p) not in names:
            parts = [part for part in name.split(".") if part != "module"]
            names[id(p)] = ".".join(parts)
    return names


@torch.no_grad()
def reinitialise(model) -> None:
    from megatron.core import parallel_state

    from megatron_slim.megatron.model.weights import full_shape, tp_shard

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    for chunk in model if isinstance(model, (list, tuple)) else [model]:
        names = _global_names(chunk)
        for p in chunk.parameters():
            flat = p.detach().reshape(-1)
            if flat.numel() == 0 or bool((flat == flat[0]).all()):
                continue
            generator = torch.Generator().manual_seed(zlib.crc32(names[id(p)].encode()))
            full = torch.randn(full_shape(p, tp_size), generator=generator, dtype=torch.float32).mul_(0.02)
            p.copy_(tp_shard(full, p, tp_rank, tp_size).to(p.dtype))


def install(training) -> None:
    get_model = training.get_model

    @functools.wraps(get_model)
    def get_model_by_name(*args, **kwargs):
        model = get_model(*args, **kwargs)
        reinitialise(model)
        return model

    training.get_model = get_model_by_name


def install_builder(gpt_models) -> None:
    """Megatron-LM from core_v0.19 builds ``pretrain_gpt.py``'s model from its config container with
    ``GPTModelBuilder.build_distributed_models``, not ``get_model``: redraw there too."""
    builder = gpt_models.GPTModelBuilder
    build = builder.build_distributed_models

    @functools.wraps(build)
    def build_by_name(self, *args, **kwargs):
        model = build(self, *args, **kwargs)
        reinitialise(model)
        return model

    builder.build_distributed_models = build_by_name
