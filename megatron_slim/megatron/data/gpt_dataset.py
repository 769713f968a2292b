"""``build_gpt_dataset``: a prepared corpus -> megatron-core ``GPTDataset`` samples.

Megatron's ``GPTDataset`` draws fixed-length samples across document boundaries from a
shuffled document order and a shuffled sample order, both from ``numpy.random.RandomState(seed)``.
By default it caches those index arrays as ``.npy`` files written by rank 0 only, and relies on
its builder's ``torch.distributed.barrier()`` before the other ranks read them; a rank that
builds alone under an initialized process group fails, and the files are written in place.

We build the index arrays in memory in every process instead (``path_to_cache=None`` with no
blend, which megatron-core treats as "nothing to cache"). They are deterministic in the seed, so
every rank gets identical samples without any collective or shared file, with or without
``torch.distributed``; building them takes milliseconds at this project's corpus sizes
(~1e7 tokens). The tokens themselves stay memory-mapped from the prepared ``.bin`` file.
"""

from __future__ import annotations

import logging
import math
from contextlib import contextmanager
from typing import Iterator

import numpy
from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.utils import Split

from megatron_slim.megatron.data.dataset import PreparedCorpus


def build_gpt_dataset(
    prepared: PreparedCorpus,
    seq_length: int,
    num_samples: int | None,
    seed: int = 1234,
    *,
    eod_mask_loss: bool = False,
    create_attention_mask: bool = False,
) -> GPTDataset | BlendedDataset:
    """``num_samples`` samples (``None``: one epoch) of ``seq_length`` tokens, shuffled by ``seed``.

    Each sample is a dict of CPU tensors of length ``seq_length``: ``tokens`` and ``labels``
    (int64; labels are the next tokens), ``loss_mask`` (float32, ones unless ``eod_mask_loss``
    zeroes the eod positions) and ``position_ids`` (int64); plus a ``[1, s, s]`` boolean
    ``attention_mask`` (True = masked) only when ``create_attention_mask`` is set: Megatron's
    causal attention does not need it.
    """
    if not isinstance(seq_length, int) or seq_length < 1:
        raise ValueError(f"seq_length={seq_length!r}: must be an integer >= 1")
    if num_samples is not None and (not isinstance(num_samples, int) or num_samples < 1):
        raise ValueError(f"num_samples={num_samples!r}: must be None (one epoch) or an integer >= 1")
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed={seed!r}: must be an integer >= 0")
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=None,
        path_to_cache=None,
        tokenizer=prepared.tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=eod_mask_loss,
        create_attention_mask=create_attention_mask,
    )
    if len(prepared.blend) > 1:
        dataset = _blended(prepared, num_samples, config)
    else:
        dataset = _one_prefix(prepared.path_prefix, num_samples, config)
    if len(dataset) == 0:
        raise ValueError(
            f"seq_length={seq_length} leaves no sample: the corpus at "
            f"{prepared.path_prefix} has {prepared.num_tokens} tokens; "
            f"use seq_length < {prepared.num_tokens} or a larger corpus"
        )
    return dataset


def _one_prefix(prefix: str, num_samples: int | None, config: GPTDatasetConfig) -> GPTDataset:
    indexed = GPTDataset.build_low_level_dataset(prefix, config)
    documents = numpy.arange(len(indexed), dtype=numpy.int32)
    with _without_megatron_cache_warning():
        return GPTDataset(indexed, prefix, documents, num_samples, Split.train, config)


def _blended(prepared: PreparedCorpus, num_samples: int | None, config: GPTDatasetConfig) -> BlendedDataset:
    """Megatron's blend of ``prepared.blend``: each prefix gets its weight's share of the samples plus
    Megatron's 0.5% margin (``BlendedMegatronDatasetBuilder``'s rule), then ``BlendedDataset`` interleaves
    them by weight, with its index built in memory as the single datasets' are."""
    if num_samples is None:
        raise ValueError("num_samples: a blend (data.path with weights) needs a sample count; allowed: an integer >= 1")
    parts = [
        _one_prefix(prefix, int(math.ceil(weight * num_samples * 1.005)), config) for weight, prefix in prepared.blend
    ]
    with _without_megatron_cache_warning():
        return BlendedDataset(parts, [w for w, _ in prepared.blend], num_samples, config)


class _DropUnableToSave(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Unable to save")


@contextmanager
def _without_megatron_cache_warning() -> Iterator[None]:
    """Silence megatron's warning that it cannot save indices: not saving them is our choice."""
    logger = logging.getLogger("megatron.core.datasets.gpt_dataset")
    drop = _DropUnableToSave()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)
