import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_slim.data import Tokenizer, list_corpus, pretokenize, train_bpe
from megatron_slim.data import tokenizer as tokenizer_module
from megatron_slim.data.tokenizer import FIRST_MERGE_ID

# Code points from many scripts and planes, plus controls and lone surrogates.
_RANGES = [(0x0, 0x7F), (0x80, 0x7FF), (0x800, 0xD7FF), (0xD800, 0xDFFF), (0xE000, 0xFFFF),
           (0x10000, 0x10FFFF)]


def _random_text(rng: random.Random, length: int) -> str:
    chars = []
    for _ in range(length):
        low, high = rng.choice(_RANGES)
        chars.append(chr(rng.randint(low, high)))
    return "".join(chars)


@pytest.fixture(scope="module")
def stdlib_docs():
    return list_corpus("stdlib", max_files=60)


@pytest.fixture(scope="module")
def stdlib_tokenizer(stdlib_docs):
    return train_bpe([d.text for d in stdlib_docs.documents[:30]], 600)


def test_pretokenize_is_lossless_on_random_unicode():
    rng = random.Random(0)
    for _ in range(200):
        text = _random_text(rng, rng.randint(0, 80))
        assert "".join(pretokenize(text)) == text


def test_round_trip_random_unicode(stdlib_tokenizer):
    rng = random.Random(1)
    for _ in range(300):
        text = _random_text(rng, rng.randint(0, 120))
        ids = stdlib_tokenizer.encode(text)
        assert all(0 <= i < stdlib_tokenizer.vocab_size for i in ids)
        assert stdlib_tokenizer.decode(ids) == text


def test_round_trip_and_compression_on_unseen_stdlib_files(stdlib_docs, stdlib_tokenizer):
    unseen = stdlib_docs.documents[30:]
    for doc in unseen:
        ids = stdlib_tokenizer.encode(doc.text)
        assert stdlib_tokenizer.decode(ids) == doc.text
    num_bytes = sum(len(d.text.encode()) for d in unseen)
    num_tokens = sum(len(stdlib_tokenizer.encode(d.text)) for d in unseen)
    assert num_tokens < 0.6 * num_bytes


def test_training_is_deterministic_and_vocab_size_is_exact(stdlib_docs):
    texts = [d.text for d in stdlib_docs.documents[:10]]
    first = train_bpe(texts, 400)
    second = train_bpe(list(texts), 400)
    assert first.merges == second.merges
    assert first.vocab_size == 400 and len(first.merges) == 400 - FIRST_MERGE_ID
    assert max(max(first.encode(t)) for t in texts) == 399


def test_training_is_independent_of_hash_seed(tmp_path, stdlib_docs):
    # Sets and dicts iterate in hash order; merges must not depend on it.
    sample = tmp_path / "sample.txt"
    sample.write_text("".join(d.text for d in stdlib_docs.documents[:5]), encoding="utf-8")
    script = (
        "import importlib.util, json, sys\n"
        f"spec = importlib.util.spec_from_file_location('tok', {tokenizer_module.__file__!r})\n"
        "tok = importlib.util.module_from_spec(spec); spec.loader.exec_module(tok)\n"
        f"text = open({str(sample)!r}, encoding='utf-8').read()\n"
        "print(json.dumps(tok.train_bpe([text], 350).merges))\n"
    )
    outputs = []
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                             text=True, check=True)
        outputs.append(json.loads(run.stdout))
    assert outputs[0] == outputs[1]
    in_process = train_bpe([sample.read_text("utf-8")], 350).merges
    assert [tuple(m) for m in outputs[0]] == list(in_process)


def test_ties_break_towards_the_smallest_pair():
    # "ab" and "cd" occur equally often; the pair of smaller ids must be merged first.
    tok = train_bpe(["cd,ab"], FIRST_MERGE_ID + 1)
    assert tok.merges == ((ord("a"), ord("b")),)


def test_small_input_gives_fewer_merges_than_asked():
    tok = train_bpe(["aaaa"], 1000)
    assert tok.vocab_size < 1000
    assert tok.decode(tok.encode("aaaa")) == "aaaa"
    assert len(tok.encode("aaaa")) == 1


def test_max_bytes_bounds_the_training_text():
    bounded = train_bpe(["xy" * 50, "zw" * 50], 300, max_bytes=100)
    learned = [bounded.token_bytes(FIRST_MERGE_ID + i) for i in range(len(bounded.merges))]
    assert learned and all(b"z" not in piece for piece in learned)


@pytest.mark.parametrize("vocab_size", [0, FIRST_MERGE_ID - 1, 300.0, "4096"])
def test_bad_vocab_size_is_rejected(vocab_size):
    with pytest.raises(ValueError, match="vocab_size"):
        train_bpe(["abc"], vocab_size)


def test_special_tokens_and_token_bytes(stdlib_tokenizer):
    tok = stdlib_tokenizer
    assert (tok.eod, tok.pad) == (256, 257)
    assert tok.decode([tok.eod, tok.pad]) == ""
    assert tok.eod not in tok.encode("any text\n")
    for rank, (a, b) in enumerate(tok.merges):
        assert tok.token_bytes(FIRST_MERGE_ID + rank) == tok.token_bytes(a) + tok.token_bytes(b)
    with pytest.raises(ValueError, match="token id"):
        tok.decode([tok.vocab_size])
    with pytest.raises(ValueError, match="token id"):
        tok.decode([-1])


def test_save_load_round_trip(tmp_path, stdlib_tokenizer):
    path = tmp_path / "tok.json"
    stdlib_tokenizer.save(path)
    loaded = Tokenizer.load(path)
    assert loaded.merges == stdlib_tokenizer.merges
    assert loaded.fingerprint == stdlib_tokenizer.fingerprint
    text = "def f(x):\n    return x ** 2  # ünïcödé ✓\n"
    assert loaded.encode(text) == stdlib_tokenizer.encode(text)


def test_load_rejects_other_formats(tmp_path, stdlib_tokenizer):
    data = stdlib_tokenizer.to_dict()
    data["version"] = 999
    path = tmp_path / "tok.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="version"):
        Tokenizer.load(path)


def test_invalid_merges_are_rejected():
    with pytest.raises(ValueError, match="merge #0"):
        Tokenizer([(1, FIRST_MERGE_ID)])
    with pytest.raises(ValueError, match="merge #0"):
        Tokenizer([(256, 1)])  # eod cannot be merged
