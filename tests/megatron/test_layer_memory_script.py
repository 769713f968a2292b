"""scripts/measure_gpu_memory.py rebuilds the layer ``megatron-slim train`` runs from torch alone
(so it runs on a GPU machine without megatron-core). On CPU in fp32 both layers must save the
same storages for backward, byte for byte, or the script measures some other layer."""

import torch

from megatron_slim.plan.recipe import ModelConfig
from megatron_slim.runtime.spawn import run_ranks
from tests.megatron import _layer_memory_workers as workers

TOKENS = 48


def test_script_layer_saves_what_the_megatron_layer_saves():
    cfg = ModelConfig(
        num_layers=1,
        hidden_size=64,
        ffn_hidden_size=160,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=256,
        seq_length=TOKENS,
    )
    megatron = run_ranks(workers.megatron_layer_saved, 1, cfg, TOKENS)[0]

    script = workers.load_script()
    backend = script.choose_backend(None, torch.device("cpu"), torch.float32).backend
    heads, groups = cfg.num_attention_heads, cfg.num_query_groups
    layer = script.LlamaLayer(cfg.hidden_size, heads, groups, cfg.ffn_hidden_size, backend)
    x = torch.randn(TOKENS, 1, cfg.hidden_size, requires_grad=True)
    with script.SavedStorages(layer) as saved:
        layer(x, script.rope_freqs(TOKENS, cfg.hidden_size // cfg.num_attention_heads, x.device))

    assert sorted(s["bytes"] for s in saved.seen.values()) == megatron
    assert sum(megatron) > TOKENS * (6 * cfg.hidden_size + 5 * cfg.ffn_hidden_size) * 4  # a whole layer's worth
