"""One rewriter of megatron-core layer specs (``megatron.layer_specs``) behind SlimPipe's,
the CP engines' and ``model.layer_spec``'s core attention."""

import pytest
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_slim.megatron import compat
from megatron_slim.megatron.cp.attention import CPCoreAttention
from megatron_slim.megatron.cp.hooks import with_cp_attention
from megatron_slim.megatron.cp.remap_layer import RemapTransformerLayer
from megatron_slim.megatron.model.gpt import layer_spec
from megatron_slim.megatron.slimpipe.hooks import with_slice_attention
from megatron_slim.megatron.slimpipe.slicing import SliceCoreAttention


def _layer(module=TransformerLayer):
    return ModuleSpec(module=module, submodules=compat.local_layer_submodules("RMSNorm"))


def _core(layer):
    return layer.submodules.self_attention.submodules.core_attention


def test_slimpipe_and_cp_engines_rewrite_layer_and_block_specs_without_touching_the_original():
    layer = _layer()
    before = _core(layer)
    assert _core(with_slice_attention(layer)) is SliceCoreAttention and _core(layer) is before
    block = TransformerBlockSubmodules(layer_specs=[_layer(), _layer()])
    rewritten = with_cp_attention(block, remap=True)
    assert all(_core(s) is CPCoreAttention and s.module is RemapTransformerLayer for s in rewritten.layer_specs)
    assert all(s.module is TransformerLayer for s in block.layer_specs)
    assert with_cp_attention(layer, remap=False).module is TransformerLayer
    assert _core(layer_spec(SliceCoreAttention)) is SliceCoreAttention


def test_a_spec_without_the_slot_or_with_a_foreign_layer_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--use-slimpipe: this layer spec has no self_attention.core_attention slot"):
        with_slice_attention(ModuleSpec(module=TransformerLayer))

    class OtherLayer(TransformerLayer):
        pass

    with pytest.raises(
        ValueError, match="--cp-remap: the layer spec builds OtherLayer; allowed: megatron-core's TransformerLayer"
    ):
        with_cp_attention(_layer(OtherLayer), remap=True)
