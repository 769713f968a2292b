"""``prepare_corpus``: corpus -> trained tokenizer + megatron indexed dataset, cached on disk.

A prepared corpus lives in ``<cache_dir>/corpora/<label>-<key>/`` where ``key`` hashes the
corpus fingerprint, the tokenizer format and training settings, and the vocabulary size, so any
change to the corpus content or settings gives a new entry and an unchanged one is reused. The
entry appears atomically (``cache.build_once``): concurrent ranks wait for the first one to
build it, and an interrupted build leaves nothing that a later run would trust.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers

from megatron_slim.data.cache import build_once, default_cache_dir, file_manifest, manifest_problem, rebuild
from megatron_slim.data.corpus import STDLIB, Corpus, list_corpus
from megatron_slim.data.tokenizer import CorpusTokenizer, check_vocab_size, train_tokenizer
from megatron_slim.megatron.data.indexed import write_tokenized_corpus

# Bump when the layout or content of a cache entry changes for the same inputs.
PIPELINE_VERSION = 3  # 2: Hugging Face tokenizers BPE; 3: file checksums in the metadata
META_FILE = "meta.json"
DATA_PREFIX = "tokens"
DEFAULT_VOCAB_SIZE = 4096
DEFAULT_TOKENIZER_TRAIN_BYTES = 2_000_000


@dataclass(frozen=True)
class PreparedCorpus:
    """A tokenized corpus ready for ``build_gpt_dataset`` or Megatron's ``--data-path``."""

    source: str
    directory: Path
    path_prefix: str
    tokenizer: CorpusTokenizer
    num_documents: int
    num_tokens: int
    num_bytes: int
    corpus_fingerprint: str
    cache_hit: bool
    blend: tuple = ()  # ((weight, prefix), ...) for a Megatron blend (data.path); () = path_prefix alone

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size


def prepare_corpus(
    corpus: str | os.PathLike = STDLIB,
    cache_dir: str | os.PathLike | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    max_files: int = 0,
    *,
    max_bytes: int = 0,
    tokenizer_train_bytes: int = DEFAULT_TOKENIZER_TRAIN_BYTES,
    tokenizer: CorpusTokenizer | None = None,
) -> PreparedCorpus:
    """Tokenize ``corpus`` (``"stdlib"`` or a directory) into a cached indexed dataset.

    ``max_files``/``max_bytes`` bound the corpus (0 = all; see ``list_corpus``). The tokenizer
    is trained on about ``tokenizer_train_bytes`` of documents spread evenly over the corpus.
    ``cache_dir`` defaults to ``$MEGATRON_SLIM_CACHE`` or ``~/.cache/megatron-slim``. A given
    ``tokenizer`` (``data.tokenizer``) is used instead of training one; its content is in the cache key.
    """
    check_vocab_size(vocab_size)
    if not isinstance(tokenizer_train_bytes, int) or tokenizer_train_bytes < 1:
        raise ValueError(f"tokenizer_train_bytes={tokenizer_train_bytes!r}: must be an integer >= 1")
    docs = list_corpus(corpus, max_files=max_files, max_bytes=max_bytes)
    settings = _cache_settings(docs, vocab_size, tokenizer_train_bytes, tokenizer)
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    entry = root / "corpora" / f"{_label(docs)}-{key}"

    def build(staging: Path) -> None:
        sample = [] if tokenizer else _training_sample(docs, tokenizer_train_bytes)
        used = tokenizer or train_tokenizer(sample, vocab_size)
        used.save(staging)
        stats = write_tokenized_corpus(staging / DATA_PREFIX, docs.texts(), used)
        meta = {
            **settings,
            "source": docs.source,
            "root": str(docs.root),
            "num_documents": stats.num_documents,
            "num_tokens": stats.num_tokens,
            "num_bytes": docs.num_bytes,
            "tokenizer_vocab_size": used.vocab_size,
            "files": file_manifest(staging),
        }
        (staging / META_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")

    built = build_once(entry, build)
    meta, rebuilt = _intact_meta(entry, build)
    return PreparedCorpus(
        source=docs.source,
        directory=entry,
        path_prefix=str(entry / DATA_PREFIX),
        tokenizer=CorpusTokenizer.load(entry),
        num_documents=meta["num_documents"],
        num_tokens=meta["num_tokens"],
        num_bytes=meta["num_bytes"],
        corpus_fingerprint=docs.fingerprint,
        cache_hit=not (built or rebuilt),
    )


def _intact_meta(entry: Path, build) -> tuple[dict[str, Any], bool]:
    """The entry's meta, building the entry again (once) when a file no longer matches its checksum."""
    meta, problem = _checked_meta(entry)
    if problem is None:
        return meta, False
    print(f"data: the cache entry {entry} is damaged ({problem}): building it again", flush=True)
    rebuild(entry, build)
    meta, problem = _checked_meta(entry)
    if problem is not None:
        raise ValueError(f"{entry}: damaged right after it was built ({problem}); is the disk full?")
    return meta, True


def _checked_meta(entry: Path) -> tuple[dict[str, Any], str | None]:
    """The entry's metadata, and why its files are not what was written (None: they are)."""
    try:
        meta = json.loads((entry / META_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return {}, f"{META_FILE} unreadable: {exc}"
    if not isinstance(meta, dict) or not {"num_documents", "num_tokens", "num_bytes"} <= set(meta):
        return {}, f"{META_FILE} lacks the corpus figures"
    return meta, manifest_problem(entry, meta.get("files"))


def _cache_settings(
    docs: Corpus, vocab_size: int, tokenizer_train_bytes: int, tokenizer: CorpusTokenizer | None
) -> dict[str, Any]:
    """Everything the cached corpus depends on: its cache key hashes these."""
    return {
        "pipeline_version": PIPELINE_VERSION,
        "corpus_fingerprint": docs.fingerprint,
        "tokenizer_format": {"library": "tokenizers", "version": tokenizers.__version__, "model": "byte-level BPE"},
        "vocab_size": vocab_size,
        "tokenizer_train_bytes": tokenizer_train_bytes,
        "given_tokenizer": (hashlib.sha256(tokenizer.hf.to_str().encode()).hexdigest() if tokenizer else None),
    }


def _label(docs: Corpus) -> str:
    """A readable name for the cache entry: ``stdlib`` or the corpus directory's name."""
    name = STDLIB if docs.source == STDLIB else docs.root.name
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:40] or "corpus"


def _training_sample(docs: Corpus, budget: int) -> list[str]:
    """Every k-th document, k chosen so the sample holds at least ``budget`` bytes when it can."""
    stride = max(1, docs.num_bytes // budget)
    return [doc.text for doc in docs.documents[::stride]]
