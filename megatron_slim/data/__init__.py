"""Training data for tiny real runs: a real text corpus, a Hugging Face tokenizer, megatron's format.

Pipeline::

    corpus.py       list_corpus("stdlib" | dir): sorted UTF-8 text files + content fingerprint
    tokenizer.py    train_tokenizer: tokenizers' byte-level BPE trained on ~2 MB spread over the corpus
    indexed.py      write_tokenized_corpus: one document per file, eod appended, written as
                    megatron-core's IndexedDataset (.bin/.idx)
    gpt_dataset.py  build_gpt_dataset: megatron-core GPTDataset samples (tokens, labels,
                    loss_mask, position_ids)

``prepare_corpus`` runs the first three steps once per (corpus content, tokenizer settings,
vocab size) and caches the result (dataset.py, cache.py)::

    $MEGATRON_SLIM_CACHE (default ~/.cache/megatron-slim)/
      corpora/
        <label>-<key16>/           label: "stdlib" or the corpus dir's name; key: settings hash
          tokenizer.json           CorpusTokenizer.save / .load (Hugging Face tokenizers; with
          tokenizer_config.json    tokenizer_config.json, loadable by Megatron's HuggingFaceTokenizer)
          tokens.bin, tokens.idx   the indexed dataset; PreparedCorpus.path_prefix = ".../tokens"
          meta.json                settings and stats (documents, tokens, bytes)
        .<entry>.lock              flock serializing concurrent builders of one entry
        .<entry>.staging-<pid>-*   an entry being built; renamed into place when complete

Multi-process use: ranks may all call ``prepare_corpus`` (the first builds, the rest wait on the
lock and reuse it) or the launcher calls it once before spawning them; ``build_gpt_dataset``
needs no collective and no shared files, so it behaves the same with or without
``torch.distributed`` initialized.
"""
from megatron_slim.data.cache import default_cache_dir
from megatron_slim.data.corpus import Corpus, Document, list_corpus, stdlib_root
from megatron_slim.data.dataset import PreparedCorpus, prepare_corpus
from megatron_slim.data.gpt_dataset import build_gpt_dataset
from megatron_slim.data.indexed import (
    IndexedStats,
    read_token_documents,
    write_token_documents,
    write_tokenized_corpus,
)
from megatron_slim.data.tokenizer import CorpusTokenizer, train_tokenizer

__all__ = [
    "Corpus",
    "Document",
    "IndexedStats",
    "PreparedCorpus",
    "CorpusTokenizer",
    "build_gpt_dataset",
    "default_cache_dir",
    "list_corpus",
    "prepare_corpus",
    "read_token_documents",
    "stdlib_root",
    "train_tokenizer",
    "write_token_documents",
    "write_tokenized_corpus",
]
