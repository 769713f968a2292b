"""Train on data that already exists in Megatron's format: ``data.path`` (Megatron's ``--data-path``:
one ``<prefix>`` of a ``<prefix>.bin``/``<prefix>.idx`` indexed dataset, or ``w1, prefix1, w2,
prefix2, ...`` for a blend) with ``data.tokenizer`` (a Hugging Face tokenizer directory or
``tokenizer.json``, the tokenizer the data was written with).

Everything is checked before any work, each error naming the field, the value and what is allowed:
both files of every prefix exist and megatron-core reads them as an indexed dataset, weights are
positive numbers, the tokenizer loads and has an end-of-document token, its vocabulary fits
``model.vocab_size``, and no token id in the data reaches ``model.vocab_size`` (a larger id would
index past the embedding table).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy

from megatron_slim.data.tokenizer import CorpusTokenizer
from megatron_slim.megatron.data.dataset import PreparedCorpus
from megatron_slim.plan.schema import ConfigError

_SCAN_CHUNK = 1 << 24  # tokens per pass when looking for the largest id


def parse_blend(path: tuple[str, ...]) -> tuple[tuple[float, str], ...]:
    """``(prefix,)`` or ``(w1, prefix1, w2, prefix2, ...)`` -> ``((weight, prefix), ...)``, weights normalised."""
    allowed = "one prefix, or weight/prefix pairs such as [0.3, /data/a_text_document, 0.7, /data/b_text_document]"
    if len(path) == 1:
        return ((1.0, path[0]),)
    if not path or len(path) % 2:
        raise ConfigError(f"data.path: {len(path)} item(s) (got {list(path)!r}; allowed: {allowed})")
    pairs = []
    for i in range(0, len(path), 2):
        try:
            weight = float(path[i])
        except ValueError:
            raise ConfigError(f"data.path[{i}]: not a weight (got {path[i]!r}; allowed: {allowed})") from None
        if not math.isfinite(weight) or weight <= 0:
            raise ConfigError(f"data.path[{i}]: weight {path[i]!r} (allowed: a finite number > 0)")
        pairs.append((weight, path[i + 1]))
    total = sum(w for w, _ in pairs)
    return tuple((w / total, prefix) for w, prefix in pairs)


def load_tokenizer(spec: str, vocab_size: int) -> CorpusTokenizer:
    """``data.tokenizer``: checked to load, to name an end-of-document token and to fit ``model.vocab_size``."""
    where = Path(spec).expanduser()
    allowed = "a Hugging Face tokenizer directory (with tokenizer.json) or a tokenizer.json file"
    if not (where.is_file() or (where / "tokenizer.json").is_file()):
        raise ConfigError(f"data.tokenizer: no tokenizer at {spec!r} (allowed: {allowed})")
    try:
        tokenizer = CorpusTokenizer.load(where)
    except (ValueError, OSError, Exception) as exc:  # tokenizers raises its own Exception subclass
        raise ConfigError(
            f"data.tokenizer: {spec!r} does not load ({exc}; allowed: {allowed} whose "
            "tokenizer_config.json names the end-of-document token as eos_token, or which has "
            "<|endoftext|>)"
        ) from None
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(
            f"model.vocab_size: {vocab_size} is smaller than data.tokenizer {spec!r}'s vocabulary "
            f"(got {vocab_size}; allowed: an integer >= {tokenizer.vocab_size})"
        )
    return tokenizer


def _read_prefix(prefix: str, index: int, vocab_size: int):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    field = f"data.path[{index}]"
    missing = [s for s in (".bin", ".idx") if not Path(prefix + s).expanduser().is_file()]
    if missing:
        raise ConfigError(
            f"{field}: {prefix!r} has no {' or '.join(prefix + s for s in missing)} (allowed: the "
            "prefix of a megatron-core indexed dataset: <prefix>.bin and <prefix>.idx, as written by "
            "Megatron-LM's tools/preprocess_data.py)"
        )
    try:
        dataset = IndexedDataset(str(Path(prefix).expanduser()))
    except Exception as exc:  # megatron-core asserts on a foreign header
        raise ConfigError(
            f"{field}: {prefix!r} is not a megatron-core indexed dataset ({type(exc).__name__}: "
            f"{exc}; allowed: <prefix>.bin/.idx written by megatron-core's "
            "IndexedDatasetBuilder)"
        ) from None
    tokens = numpy.memmap(Path(prefix + ".bin").expanduser(), dtype=dataset.index.dtype, mode="r")
    largest = max((int(tokens[i : i + _SCAN_CHUNK].max()) for i in range(0, tokens.size, _SCAN_CHUNK)), default=-1)
    if largest >= vocab_size:
        raise ConfigError(
            f"model.vocab_size: {prefix!r} holds token id {largest}, past the embedding table (got "
            f"{vocab_size}; allowed: an integer > {largest}, or data written with this tokenizer)"
        )
    return len(dataset), int(tokens.size), int(Path(prefix + ".bin").expanduser().stat().st_size)


def prepare_megatron_data(path: tuple[str, ...], tokenizer: str, vocab_size: int) -> PreparedCorpus:
    """The recipe's existing Megatron data and tokenizer, checked (see the module doc)."""
    if not tokenizer:
        raise ConfigError(
            f"data.tokenizer: required with data.path {list(path)!r} (got ''; allowed: the Hugging "
            "Face tokenizer directory or tokenizer.json the data was written with)"
        )
    blend = parse_blend(path)
    loaded = load_tokenizer(tokenizer, vocab_size)
    stats = [_read_prefix(prefix, 2 * i + (len(blend) > 1), vocab_size) for i, (_, prefix) in enumerate(blend)]
    first = str(Path(blend[0][1]).expanduser())
    return PreparedCorpus(
        source=f"data.path {' '.join(path)}",
        directory=Path(first).parent,
        path_prefix=first,
        tokenizer=loaded,
        num_documents=sum(s[0] for s in stats),
        num_tokens=sum(s[1] for s in stats),
        num_bytes=sum(s[2] for s in stats),
        corpus_fingerprint="",
        cache_hit=True,
        blend=tuple((w, str(Path(p).expanduser())) for w, p in blend),
    )
