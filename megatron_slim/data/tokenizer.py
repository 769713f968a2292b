"""A deterministic byte-level BPE tokenizer, trained and used in pure Python.

Ids ``0..255`` are the raw bytes, then the special tokens (``eod``, ``pad``), then one id per
learned merge in the order it was learned. Text is first split by ``PRETOKENIZE_PATTERN`` into
word-like pieces; merges never cross a piece boundary, so training counts each unique piece once
(weighted by its frequency) and encoding caches the ids of every unique piece it has seen.

Because the base alphabet is bytes, ``decode(encode(text)) == text`` for any ``str`` (lone
surrogates included: text is encoded to UTF-8 with ``surrogatepass``).
"""
from __future__ import annotations

import hashlib
import heapq
import json
import re
from collections import Counter
from functools import cached_property
from pathlib import Path
from typing import Iterable, Sequence

FORMAT_NAME = "megatron-slim-byte-bpe"
FORMAT_VERSION = 1

# Runs of letters and underscores (so "__init__" is one piece; digits split off), runs of
# digits, runs of punctuation, and whitespace. A single optional leading space stays with the
# next piece; a whitespace run keeps its last space for the following word (GPT-2's trick), so
# indentation "    def" becomes "   " + " def". The classes cover every character, so splitting
# is lossless.
PRETOKENIZE_PATTERN = r" ?[^\W\d]+| ?\d+| ?[^\s\w]+|\s+(?!\S)|\s+"
_PRETOKENIZE = re.compile(PRETOKENIZE_PATTERN)

NUM_BYTES = 256
SPECIAL_TOKENS = ("eod", "pad")
FIRST_MERGE_ID = NUM_BYTES + len(SPECIAL_TOKENS)
_TEXT_ERRORS = "surrogatepass"
_MAX_CACHED_PIECES = 1 << 20


def pretokenize(text: str) -> list[str]:
    """Split ``text`` into the pieces BPE merges within; ``"".join(result) == text``."""
    return _PRETOKENIZE.findall(text)


class Tokenizer:
    """A trained byte-level BPE tokenizer; build one with ``train_bpe`` or ``Tokenizer.load``."""

    def __init__(self, merges: Sequence[tuple[int, int]]) -> None:
        self.merges: tuple[tuple[int, int], ...] = tuple((int(a), int(b)) for a, b in merges)
        self._ranks: dict[tuple[int, int], int] = {}
        pieces: list[bytes] = [bytes([i]) for i in range(NUM_BYTES)] + [b""] * len(SPECIAL_TOKENS)
        for rank, (a, b) in enumerate(self.merges):
            new_id = FIRST_MERGE_ID + rank
            in_range = 0 <= a < new_id and 0 <= b < new_id
            if not in_range or self._is_special(a) or self._is_special(b):
                raise ValueError(f"merge #{rank} {(a, b)} must combine two earlier non-special "
                                 f"ids in [0, {new_id})")
            if (a, b) in self._ranks:
                raise ValueError(f"merge #{rank} {(a, b)} is a duplicate")
            self._ranks[(a, b)] = rank
            pieces.append(pieces[a] + pieces[b])
        self._bytes = pieces
        self._cache: dict[str, tuple[int, ...]] = {}

    @staticmethod
    def _is_special(token_id: int) -> bool:
        return NUM_BYTES <= token_id < FIRST_MERGE_ID

    @property
    def vocab_size(self) -> int:
        return FIRST_MERGE_ID + len(self.merges)

    @property
    def eod(self) -> int:
        """End-of-document id, appended after every document in the indexed dataset."""
        return NUM_BYTES + SPECIAL_TOKENS.index("eod")

    @property
    def pad(self) -> int:
        """Padding id; never produced by ``encode``."""
        return NUM_BYTES + SPECIAL_TOKENS.index("pad")

    @cached_property
    def fingerprint(self) -> str:
        """A hash of everything that decides the encoding (pattern, specials, merges)."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()

    @property
    def unique_identifiers(self) -> dict[str, str]:
        """What megatron-core's dataset config hashes to identify the tokenizer."""
        return {"class": f"{__name__}.{type(self).__qualname__}", "fingerprint": self.fingerprint}

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (empty for special tokens)."""
        return self._bytes[token_id]

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        cache = self._cache
        for piece in _PRETOKENIZE.findall(text):
            piece_ids = cache.get(piece)
            if piece_ids is None:
                piece_ids = self._encode_piece(piece.encode("utf-8", _TEXT_ERRORS))
                if len(cache) >= _MAX_CACHED_PIECES:
                    cache.clear()
                cache[piece] = piece_ids
            ids += piece_ids
        return ids

    def _encode_piece(self, data: bytes) -> tuple[int, ...]:
        word = list(data)
        ranks = self._ranks
        while len(word) > 1:
            best_rank = None
            for pair in zip(word, word[1:]):
                rank = ranks.get(pair)
                if rank is not None and (best_rank is None or rank < best_rank):
                    best_rank = rank
            if best_rank is None:
                break
            word = _merge_pair(word, self.merges[best_rank], FIRST_MERGE_ID + best_rank)
        return tuple(word)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; special tokens decode to nothing, invalid UTF-8 to U+FFFD."""
        ids = list(ids)
        if ids and not (0 <= min(ids) and max(ids) < self.vocab_size):
            bad = next(i for i in ids if not 0 <= i < self.vocab_size)
            raise ValueError(f"token id {bad} is outside [0, {self.vocab_size})")
        data = b"".join([self._bytes[i] for i in ids])
        try:
            return data.decode("utf-8", _TEXT_ERRORS)
        except UnicodeDecodeError:
            return data.decode("utf-8", "replace")

    def to_dict(self) -> dict:
        return {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "pretokenize_pattern": PRETOKENIZE_PATTERN,
            "special_tokens": {name: NUM_BYTES + i for i, name in enumerate(SPECIAL_TOKENS)},
            "merges": [list(pair) for pair in self.merges],
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict()) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> "Tokenizer":
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        expected = cls([]).to_dict()
        for key in ("format", "version", "pretokenize_pattern", "special_tokens"):
            if data.get(key) != expected[key]:
                raise ValueError(f"{path}: {key}={data.get(key)!r} is not supported; "
                                 f"this version reads {key}={expected[key]!r}")
        return cls([tuple(pair) for pair in data["merges"]])

    def __getstate__(self) -> dict:
        # The piece cache can hold ~1e6 entries; data-loader workers rebuild their own.
        return {**self.__dict__, "_cache": {}}

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, eod={self.eod}, pad={self.pad})"


def _merge_pair(word: list[int], pair: tuple[int, int], new_id: int) -> list[int]:
    """``word`` with every non-overlapping occurrence of ``pair`` (left to right) replaced."""
    first, second = pair
    out: list[int] = []
    i, n = 0, len(word)
    while i < n:
        if i + 1 < n and word[i] == first and word[i + 1] == second:
            out.append(new_id)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


def check_vocab_size(vocab_size: object) -> None:
    if not isinstance(vocab_size, int) or vocab_size < FIRST_MERGE_ID:
        raise ValueError(f"vocab_size={vocab_size!r}: must be an integer >= {FIRST_MERGE_ID} "
                         f"(256 bytes + {len(SPECIAL_TOKENS)} special tokens)")


def train_bpe(texts: Iterable[str], vocab_size: int, *, max_bytes: int | None = None) -> Tokenizer:
    """Learn ``vocab_size - 258`` merges from ``texts`` (fewer if the texts run out of pairs).

    Reads texts until ``max_bytes`` UTF-8 bytes have been seen (``None``: all of them). The most
    frequent pair wins; ties go to the smallest ``(left_id, right_id)``, so the same texts always
    give the same merges.
    """
    check_vocab_size(vocab_size)
    if max_bytes is not None and max_bytes < 1:
        raise ValueError(f"max_bytes={max_bytes!r}: must be None or an integer >= 1")
    piece_counts = _count_pieces(texts, max_bytes)
    words = [list(piece.encode("utf-8", _TEXT_ERRORS)) for piece in piece_counts]
    freqs = list(piece_counts.values())
    return Tokenizer(_learn_merges(words, freqs, vocab_size - FIRST_MERGE_ID))


def _count_pieces(texts: Iterable[str], max_bytes: int | None) -> Counter[str]:
    counts: Counter[str] = Counter()
    seen = 0
    for text in texts:
        if max_bytes is not None:
            encoded = text.encode("utf-8", _TEXT_ERRORS)
            if seen + len(encoded) > max_bytes:
                # Cut at a byte budget; "ignore" drops a split multi-byte character at the edge.
                text = encoded[: max_bytes - seen].decode("utf-8", "ignore")
            seen += len(encoded)
        counts.update(_PRETOKENIZE.findall(text))
        if max_bytes is not None and seen >= max_bytes:
            break
    return counts


def _learn_merges(words: list[list[int]], freqs: list[int],
                  num_merges: int) -> list[tuple[int, int]]:
    """Greedy BPE over weighted words with incremental pair counts and a lazy max-heap."""
    pair_counts: dict[tuple[int, int], int] = {}
    pair_words: dict[tuple[int, int], set[int]] = {}
    for index, (word, freq) in enumerate(zip(words, freqs)):
        for pair in zip(word, word[1:]):
            pair_counts[pair] = pair_counts.get(pair, 0) + freq
            pair_words.setdefault(pair, set()).add(index)
    # Every count change pushes a fresh entry, so an entry whose count disagrees is stale.
    heap = [(-count, pair) for pair, count in pair_counts.items()]
    heapq.heapify(heap)
    merges: list[tuple[int, int]] = []
    while len(merges) < num_merges and heap:
        neg_count, pair = heapq.heappop(heap)
        if pair_counts.get(pair, 0) != -neg_count:
            continue
        new_id = FIRST_MERGE_ID + len(merges)
        merges.append(pair)
        changed: set[tuple[int, int]] = set()
        for index in pair_words.pop(pair):
            word, freq = words[index], freqs[index]
            merged = _merge_pair(word, pair, new_id)
            if len(merged) == len(word):
                continue
            for old in zip(word, word[1:]):
                pair_counts[old] -= freq
                changed.add(old)
            for new in zip(merged, merged[1:]):
                pair_counts[new] = pair_counts.get(new, 0) + freq
                pair_words.setdefault(new, set()).add(index)
                changed.add(new)
            words[index] = merged
        del pair_counts[pair]
        changed.discard(pair)
        for other in changed:
            count = pair_counts[other]
            if count > 0:
                heapq.heappush(heap, (-count, other))
            else:
                del pair_counts[other]
                pair_words.pop(other, None)
    return merges
