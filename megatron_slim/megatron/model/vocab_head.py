"""GPT chunks under ``schedule.vocab_parallel``: each pipeline rank's copies of the output and word
embedding weights, the last stage's chunk giving its final hidden states instead of the loss
(``runtime/pipeline/vocab.py`` runs the output layer on every rank) and the first stage's word
embedding looking up over every rank (``runtime/pipeline/vocab_embedding.py``)."""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from megatron_slim.megatron.slimpipe.exchange_group import vocab_group
from megatron_slim.runtime.pipeline.vocab_embedding import EmbeddingExchange
from megatron_slim.runtime.pipeline.vocab_weights import VocabHead, bounds_of


def build_vocab_head(chunks: list, groups) -> VocabHead:
    """The output weight this rank computes its logits with: the chunk's own output layer on the last
    stage, the word embedding on the first stage of a tied model, else a replica (not an optimizer
    parameter: ``VocabHead.refresh`` copies the last stage's weight into it before every step).
    Untied, the replicas hold only this rank's vocabulary shard, and ``embedding`` holds the word
    embedding's copies (the first stage's own, replicas of this rank's shard elsewhere: each rank
    looks up only its shard's ids, ``runtime/pipeline/vocab_embedding.py``). Tied, the replicas stay
    whole (the first and last stages' owned copies are both whole, and ``refresh`` broadcasts).
    Under tensor parallelism "whole" is this TP rank's vocabulary shard, from ``offset``."""
    first, last = chunks[0], chunks[-1]
    first_pre, _, tied = _roles(first)
    _, last_post, _ = _roles(last)
    ranks = dist.get_process_group_ranks(groups.pp) if groups.pp_size > 1 else [dist.get_rank()]
    group = vocab_group(groups.pp) if groups.pp_size > 1 else groups.pp
    vocab, tp = _tp_shard(last.vocab_size, groups)
    rows = bounds_of(vocab, len(ranks), groups.pp_rank)
    if tied and first_pre:
        weight, owned = first.embedding.word_embeddings.weight, True
    elif last_post:
        weight, owned = last.output_layer.weight, True
    else:
        weight, owned = _replica(last, vocab if tied else rows[1] - rows[0]), False
    embedding = None
    if not tied:  # the word embedding's own copies: the first stage's, shard replicas elsewhere
        if first_pre:
            weight_e, owned_e = first.embedding.word_embeddings.weight, True
        else:
            weight_e, owned_e = _replica(last, rows[1] - rows[0]), False
        embedding = VocabHead(weight_e, owned_e, group, ranks, source=0, vocab_size=vocab, sharded=True, **tp)
    cp_group = groups.cp if groups.cp_size > 1 else None
    head = VocabHead(
        weight,
        owned,
        group,
        ranks,
        embedding=embedding,
        vocab_size=vocab,
        sharded=not tied,
        cp_group=cp_group,
        **tp,
    )
    head.refresh()
    return head


def _tp_shard(vocab_size: int, groups) -> tuple[int, dict]:
    """This TP rank's rows of the vocabulary (Megatron's vocabulary-parallel split) and the
    ``VocabHead`` fields that place them; groups without TP fields (the launcher's) are tp=1."""
    size = getattr(groups, "tp_size", 1)
    rows = vocab_size // size
    return rows, dict(offset=getattr(groups, "tp_rank", 0) * rows, tp_group=groups.tp if size > 1 else None)


def _roles(chunk) -> tuple[bool, bool, bool]:
    """(pre_process, post_process, tied embeddings) of a chunk: megatron-slim's own chunks carry
    them in ``slim_chunk_info``, Megatron-LM's ``GPTModel`` in its own attributes."""
    info = getattr(chunk, "slim_chunk_info", None)
    if info is not None:
        return info.pre_process, info.post_process, info.tied_embeddings
    return chunk.pre_process, chunk.post_process, bool(chunk.share_embeddings_and_output_weights)


def unwrapped(chunk):
    """The model inside Megatron's wrappers (``DistributedDataParallel``, ``Float16Module``)."""
    while isinstance(getattr(chunk, "module", None), torch.nn.Module):
        chunk = chunk.module
    return chunk


def _replica(chunk, rows: int) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.empty(rows, chunk.config.hidden_size, dtype=chunk.config.params_dtype))


@contextlib.contextmanager
def distributed_lookup(chunk, exchange: Optional[EmbeddingExchange]) -> Iterator[None]:
    """Within it, a first-stage chunk's word embedding looks its ids up over every pipeline rank
    (``exchange.lookup``); other chunks, or no exchange, are left as they are."""
    chunk = unwrapped(chunk)
    if exchange is None or not _roles(chunk)[0]:
        yield
        return
    module = chunk.embedding.word_embeddings
    module.forward = exchange.lookup
    try:
        yield
    finally:
        del module.forward


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
