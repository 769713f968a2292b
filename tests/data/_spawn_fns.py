"""Functions run on spawned gloo ranks by the data tests (must be importable)."""

import torch.distributed as dist

from megatron_slim.megatron.data import build_gpt_dataset, prepare_corpus


def prepare_and_sample(rank, world_size, cache_dir, vocab_size, max_files, seq_length):
    """Every rank prepares the same corpus concurrently, then draws samples under gloo."""
    assert dist.is_initialized()
    prepared = prepare_corpus("stdlib", cache_dir=cache_dir, vocab_size=vocab_size, max_files=max_files)
    dataset = build_gpt_dataset(prepared, seq_length, num_samples=50, seed=3)
    dist.barrier()
    return prepared.cache_hit, [dataset[i]["tokens"].tolist() for i in range(len(dataset))]
