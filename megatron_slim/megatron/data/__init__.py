"""Training data in Megatron's format: the corpus and tokenizer of ``megatron_slim.data`` written as
megatron-core's indexed dataset, and megatron-core ``GPTDataset`` samples drawn from it.

Pipeline::

    megatron_slim.data  list_corpus, train_tokenizer (no megatron)
    indexed.py          write_tokenized_corpus: one document per file, eod appended, written as
                        megatron-core's IndexedDataset (.bin/.idx)
    gpt_dataset.py      build_gpt_dataset: megatron-core GPTDataset samples (tokens, labels,
                        loss_mask, position_ids)
    existing.py         prepare_megatron_data: data already in Megatron's format (``data.path``)

``prepare_corpus`` runs the first steps once per (corpus content, tokenizer settings, vocab size)
and caches the result (dataset.py, ``megatron_slim.data.cache``)::

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

from megatron_slim.megatron.data.dataset import PreparedCorpus, prepare_corpus
from megatron_slim.megatron.data.gpt_dataset import build_gpt_dataset
from megatron_slim.megatron.data.indexed import (
    IndexedStats,
    read_token_documents,
    write_token_documents,
    write_tokenized_corpus,
)

__all__ = [
    "IndexedStats",
    "PreparedCorpus",
    "build_gpt_dataset",
    "prepare_corpus",
    "read_token_documents",
    "write_token_documents",
    "write_tokenized_corpus",
]
