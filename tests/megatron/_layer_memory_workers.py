"""Rank function for test_layer_memory_script: the storages megatron-core's local Llama layer
(as ``megatron-slim train`` builds it) saves for backward, tallied by the measurement script's
own counter."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "measure_gpu_memory.py"


def load_script():
    spec = importlib.util.spec_from_file_location("measure_gpu_memory", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def megatron_layer_saved(rank, world_size, cfg, tokens):
    """Sorted byte sizes of the unique storages one megatron-core layer saves for ``tokens``."""
    from megatron_slim.megatron.model.gpt import build_chunk, decoder_layers
    from megatron_slim.megatron.model.parallel import model_parallel

    script = load_script()
    with model_parallel(seed=1) as groups:
        chunk = build_chunk(cfg, groups, layers=range(cfg.num_layers), pre_process=True, post_process=True, seed=1)
        layer = decoder_layers([chunk])[0]
        x = torch.randn(tokens, 1, cfg.hidden_size, requires_grad=True)
        with script.SavedStorages(layer) as saved:
            layer(hidden_states=x, attention_mask=None, rotary_pos_emb=chunk.rotary_pos_emb(tokens))
    return sorted(s["bytes"] for s in saved.seen.values())
