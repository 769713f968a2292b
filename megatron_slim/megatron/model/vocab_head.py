"""GPT chunks under ``schedule.vocab_parallel``: each pipeline rank's copy of the output weight, and
the last stage's chunk giving its final hidden states instead of the loss (``runtime/pipeline/vocab.py``
runs the output layer on every rank)."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist

from megatron_slim.runtime.pipeline.vocab import VocabHead


def build_vocab_head(chunks: list, groups) -> VocabHead:
    """The output weight this rank computes its logits with: the chunk's own output layer on the last
    stage, the word embedding on the first stage of a tied model, else a replica (not an optimizer
    parameter: ``VocabHead.refresh`` copies the last stage's weight into it before every step)."""
    first, last = chunks[0], chunks[-1]
    tied = first.slim_chunk_info.tied_embeddings
    if tied and first.slim_chunk_info.pre_process:
        weight, owned = first.embedding.word_embeddings.weight, True
    elif last.slim_chunk_info.post_process:
        weight, owned = last.output_layer.weight, True
    else:
        weight = torch.nn.Parameter(
            torch.empty(last.vocab_size, last.config.hidden_size, dtype=last.config.params_dtype)
        )
        owned = False
    ranks = dist.get_process_group_ranks(groups.pp) if groups.pp_size > 1 else [dist.get_rank()]
    head = VocabHead(weight, owned, groups.pp, ranks)
    head.refresh()
    return head


@contextlib.contextmanager
def final_hidden_states(chunk) -> Iterator[None]:
    """Within it, a last-stage chunk's forward stops after the final norm (megatron's ``GPTModel``
    returns its decoder's output when ``post_process`` is off; the decoder, built with it on, still
    applies the final norm)."""
    kept = chunk.post_process
    chunk.post_process = False
    try:
        yield
    finally:
        chunk.post_process = kept
