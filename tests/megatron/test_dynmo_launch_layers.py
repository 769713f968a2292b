"""The pure parts of early exit, mixture of depths and freezing through the launcher: the layer
class swapped into Megatron-LM's spec, the routed attention mask, the token counter and when
frozen layers may skip their weight gradients."""

import argparse

import pytest
import torch
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_slim.megatron import compat
from megatron_slim.megatron.dynmo.freeze import weight_grads_kept_by
from megatron_slim.megatron.dynmo.layers import dynamic_layer_swap, with_dynamic_layer
from megatron_slim.megatron.dynmo.token_counts import _rows
from megatron_slim.megatron.model.early_exit import EarlyExitTransformerLayer, ExitRule
from megatron_slim.megatron.model.mixture_of_depths import MixtureOfDepthsLayer, routed_mask


def _args(**flags) -> argparse.Namespace:
    base = {"dynmo_exit_threshold": 0.0, "dynmo_exit_from_layer": 1, "dynmo_mod_capacity": 0.0}
    return argparse.Namespace(**{**base, **flags})


def _layer(module=TransformerLayer):
    return ModuleSpec(module=module, submodules=compat.local_layer_submodules("RMSNorm"))


def test_the_flags_swap_the_layer_class_into_layer_and_block_specs():
    assert dynamic_layer_swap(_args()) is None and dynamic_layer_swap(None) is None
    layer = _layer()
    assert with_dynamic_layer(layer, _args()) is layer
    exits = with_dynamic_layer(layer, _args(dynmo_exit_threshold=0.3, dynmo_exit_from_layer=2)).module
    assert issubclass(exits, EarlyExitTransformerLayer) and exits.exit_rule == ExitRule(0.3, 2)
    assert layer.module is TransformerLayer  # the builder's spec is copied, not changed
    block = TransformerBlockSubmodules(layer_specs=[_layer(), _layer()])
    routed = with_dynamic_layer(block, _args(dynmo_mod_capacity=0.25))
    assert all(issubclass(s.module, MixtureOfDepthsLayer) and s.module.capacity == 0.25 for s in routed.layer_specs)


def test_a_foreign_layer_class_is_refused_naming_the_flag():
    foreign = type("OtherLayer", (TransformerLayer,), {})
    with pytest.raises(ValueError, match="--dynmo-mod-capacity: the layer spec builds OtherLayer; allowed: megatron"):
        with_dynamic_layer(_layer(foreign), _args(dynmo_mod_capacity=0.5))


def test_the_routed_mask_keeps_the_entries_between_each_sequences_routed_tokens():
    s, b, k = 7, 3, 4
    generator = torch.Generator().manual_seed(0)
    mask = torch.rand(1, 1, s, s, generator=generator) > 0.5
    chosen = torch.stack([torch.randperm(s, generator=generator)[:k].sort().values for _ in range(b)], dim=1)
    got = routed_mask(mask, chosen)
    assert got.shape == (b, 1, k, k)
    for j in range(b):
        for x in range(k):
            for y in range(k):
                assert got[j, 0, x, y] == mask[0, 0, chosen[x, j], chosen[y, j]]
    with pytest.raises(ValueError, match="allowed attention_mask: None or one"):
        routed_mask(mask[0], chosen)


def test_token_rows_count_every_position_of_a_hidden_input():
    assert _rows((torch.zeros(5, 2, 8),), {}) == 10
    assert _rows((), {"hidden_states": torch.zeros(3, 1, 8)}) == 3


@pytest.mark.parametrize(
    ("flags", "kept_by"),
    [
        ({}, None),
        ({"overlap_grad_reduce": True}, "--overlap-grad-reduce"),
        ({"use_megatron_fsdp": True}, "--use-megatron-fsdp"),
        ({"overlap_grad_reduce": False, "use_torch_fsdp2": True}, "--use-torch-fsdp2"),
    ],
)
def test_frozen_layers_skip_weight_gradients_unless_ddp_waits_for_them(flags, kept_by):
    assert weight_grads_kept_by(argparse.Namespace(**flags)) == kept_by


class _Span:
    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end


class _ShardedOptimizer:
    """Stands for a DistributedOptimizer holding ``[start, end)`` of a parameter's flattened data."""

    def __init__(self, param: torch.Tensor, start: int, end: int) -> None:
        self.span = _Span(start, end)
        self.shard = param.detach().reshape(-1)[start:end].clone()
        self.model_fp32_groups, self.shard_fp32_groups = [[param]], [[self.shard]]
        self.optimizer = argparse.Namespace(state={self.shard: {"exp_avg": torch.ones(end - start), "step": 3}})

    def _get_model_param_range_map(self, param):
        return {"param": self.span}


def test_masks_reach_the_shard_of_a_parameter_and_its_moments():
    from megatron_slim.megatron.dynmo.main_params import MainParams

    param = torch.arange(1.0, 13.0).view(3, 4)
    sharded = _ShardedOptimizer(param, 5, 10)
    mask = torch.zeros(3, 4, dtype=torch.bool)
    mask[:, 1] = True  # column 1: flat positions 1, 5, 9
    [(part, tensors)] = MainParams(sharded).masked(param, mask)
    assert part.tolist() == [True, False, False, False, True]  # flat 5..9
    assert tensors[0] is sharded.shard and len(tensors) == 2 and tensors[1].shape == (5,)  # step is not a tensor
