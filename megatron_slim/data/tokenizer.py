"""The corpus tokenizer: a Hugging Face ``tokenizers`` byte-level BPE, trained offline on the corpus.

It is saved the way Hugging Face tools and Megatron-LM read it: ``tokenizer.json`` (the
``tokenizers`` model) plus ``tokenizer_config.json`` naming ``PreTrainedTokenizerFast`` and the
end-of-document token as ``eos_token``. Megatron-LM loads that directory with
``--tokenizer-type HuggingFaceTokenizer --tokenizer-model <dir>`` (its ``_HuggingFaceTokenizer``
takes ``eod`` from ``eos_token_id``), so a corpus prepared here can be trained on by
``pretrain_gpt.py`` as is.

Byte-level: the base alphabet is the 256 bytes, so any text round-trips. Only ``tokenizers`` is
needed at run time; ``transformers`` is needed only by Megatron's loader.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOD_TOKEN = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
MIN_VOCAB_SIZE = 257  # the 256 bytes and the end-of-document token


def check_vocab_size(vocab_size: object) -> None:
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size={vocab_size!r}: must be an integer >= {MIN_VOCAB_SIZE} (256 bytes + the end-of-document token)"
        )


class CorpusTokenizer:
    """What the data pipeline and megatron-core's ``GPTDataset`` need from a tokenizer: ``encode``,
    ``decode``, ``eod``, ``vocab_size`` and ``unique_identifiers`` (GPTDataset's cache description)."""

    def __init__(self, tokenizer: Tokenizer, eod_token: str = EOD_TOKEN, source: str = "") -> None:
        eod = tokenizer.token_to_id(eod_token)
        if eod is None:
            raise ValueError(f"tokenizer {source or '(in memory)'}: has no end-of-document token {eod_token!r}")
        # a document that contains the literal "<|endoftext|>" (this file does) stays one document
        tokenizer.encode_special_tokens = True
        self.hf = tokenizer
        self.eod_token = eod_token
        self.eod = eod
        self.source = source

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    @property
    def unique_identifiers(self) -> dict[str, str]:
        return {"class": type(self).__name__, "tokenizer": self.hf.to_str()}

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """``encode`` of each text, in parallel (the library's thread pool)."""
        return [e.ids for e in self.hf.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=True)  # eod decodes to ""

    def save(self, directory: str | Path) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``directory``."""
        directory = Path(directory)
        self.hf.save(str(directory / TOKENIZER_FILE))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": self.eod_token,
            "bos_token": self.eod_token,
            "unk_token": None,
            "model_max_length": 1 << 30,
            "clean_up_tokenization_spaces": False,
        }
        (directory / CONFIG_FILE).write_text(json.dumps(config, indent=1) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | os.PathLike) -> "CorpusTokenizer":
        """A tokenizer directory (``tokenizer.json`` with an optional ``tokenizer_config.json``
        naming ``eos_token``) or a ``tokenizer.json`` file."""
        path = Path(path).expanduser()
        file = path / TOKENIZER_FILE if path.is_dir() else path
        config_file = file.parent / CONFIG_FILE
        eod_token = EOD_TOKEN
        if config_file.is_file():
            eos = json.loads(config_file.read_text(encoding="utf-8")).get("eos_token")
            eod_token = eos.get("content", EOD_TOKEN) if isinstance(eos, dict) else (eos or EOD_TOKEN)
        return cls(Tokenizer.from_file(str(file)), eod_token, source=str(path))

    def __getstate__(self) -> dict:
        return {"json": self.hf.to_str(), "eod_token": self.eod_token, "source": self.source}

    def __setstate__(self, state: dict) -> None:
        type(self).__init__(self, Tokenizer.from_str(state["json"]), state["eod_token"], state["source"])

    def __repr__(self) -> str:
        return f"CorpusTokenizer(vocab_size={self.vocab_size}, eod={self.eod}, source={self.source!r})"


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> CorpusTokenizer:
    """Byte-level BPE with ``vocab_size`` ids at most (fewer if the texts hold fewer merges):
    the 256 bytes, ``<|endoftext|>`` (id 0), then the learned merges."""
    check_vocab_size(vocab_size)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD_TOKEN],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return CorpusTokenizer(tokenizer)
