"""Tokenized documents in megatron-core's indexed dataset format (``<prefix>.bin`` + ``.idx``).

One document per corpus file, one sequence per document, the tokenizer's ``eod`` appended to
each: the layout Megatron-LM's ``tools/preprocess_data.py`` writes with ``--append-eod`` and
that ``GPTDataset`` reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy
from megatron.core.datasets.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetBuilder,
    get_bin_path,
    get_idx_path,
)

from megatron_slim.data.tokenizer import CorpusTokenizer


@dataclass(frozen=True)
class IndexedStats:
    num_documents: int
    num_tokens: int


def token_dtype(vocab_size: int) -> type[numpy.number]:
    """The narrowest dtype megatron-core reads that holds every id below ``vocab_size``."""
    return numpy.uint16 if vocab_size <= numpy.iinfo(numpy.uint16).max + 1 else numpy.int32


def write_token_documents(prefix: str | Path, documents: Iterable[Sequence[int]], vocab_size: int) -> IndexedStats:
    """Write each id sequence in ``documents`` as one document; return the counts."""
    dtype = token_dtype(vocab_size)
    builder = IndexedDatasetBuilder(get_bin_path(str(prefix)), dtype=dtype)
    num_documents = num_tokens = 0
    for ids in documents:
        if not ids:
            raise ValueError(f"document #{num_documents} is empty; every document needs >= 1 token")
        array = numpy.asarray(ids, dtype=dtype)
        builder.add_document(array, [array.size])
        num_documents += 1
        num_tokens += array.size
    builder.finalize(get_idx_path(str(prefix)))
    return IndexedStats(num_documents, num_tokens)


def write_tokenized_corpus(prefix: str | Path, texts: Iterable[str], tokenizer: CorpusTokenizer) -> IndexedStats:
    """Encode each text, append ``eod`` and write them all as an indexed dataset at ``prefix``."""
    return write_token_documents(prefix, _encoded_documents(texts, tokenizer), tokenizer.vocab_size)


def _encoded_documents(texts: Iterable[str], tokenizer: CorpusTokenizer, batch: int = 256) -> Iterator[list[int]]:
    pending: list[str] = []
    for text in [*texts, None]:
        if text is not None:
            pending.append(text)
        if pending and (text is None or len(pending) == batch):
            for ids in tokenizer.encode_batch(pending):
                yield ids + [tokenizer.eod]
            pending = []


def read_token_documents(prefix: str | Path) -> list[numpy.ndarray]:
    """Every document of the indexed dataset at ``prefix`` as an int64 array (for checks, tools)."""
    dataset = IndexedDataset(str(prefix))
    documents = [numpy.asarray(dataset[i], dtype=numpy.int64) for i in range(len(dataset))]
    del dataset
    return documents
