"""The corpus tokenizer (Hugging Face ``tokenizers`` byte-level BPE): lossless, deterministic, and
loadable by Megatron-LM's own ``HuggingFaceTokenizer``."""

import argparse
import random
import sys

import pytest

from megatron_slim.data import CorpusTokenizer, list_corpus, train_tokenizer
from megatron_slim.data.tokenizer import EOD_TOKEN
from tests.real_megatron.harness import installed_tag

_RANGES = [(0x0, 0x7F), (0x80, 0x7FF), (0x800, 0xD7FF), (0xE000, 0xFFFF), (0x10000, 0x10FFFF)]


def _random_text(rng: random.Random, length: int) -> str:
    return "".join(chr(rng.randint(*rng.choice(_RANGES))) for _ in range(length))


@pytest.fixture(scope="module")
def stdlib_docs():
    return list_corpus("stdlib", max_files=60)


@pytest.fixture(scope="module")
def stdlib_tokenizer(stdlib_docs):
    return train_tokenizer([d.text for d in stdlib_docs.documents[:30]], 600)


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
        assert stdlib_tokenizer.decode(stdlib_tokenizer.encode(doc.text)) == doc.text
    num_bytes = sum(len(d.text.encode()) for d in unseen)
    num_tokens = sum(len(stdlib_tokenizer.encode(d.text)) for d in unseen)
    assert num_tokens < 0.6 * num_bytes
    assert stdlib_tokenizer.encode_batch([d.text for d in unseen]) == [stdlib_tokenizer.encode(d.text) for d in unseen]


def test_training_is_deterministic_and_vocab_size_is_exact(stdlib_docs):
    texts = [d.text for d in stdlib_docs.documents[:10]]
    first, second = train_tokenizer(texts, 400), train_tokenizer(list(texts), 400)
    assert first.hf.to_str() == second.hf.to_str()
    assert first.vocab_size == 400
    assert max(max(first.encode(t)) for t in texts) == 399


def test_small_input_gives_fewer_ids_than_asked():
    tok = train_tokenizer(["aaaa"], 1000)
    assert tok.vocab_size < 1000
    assert tok.decode(tok.encode("aaaa")) == "aaaa" and len(tok.encode("aaaa")) == 1


@pytest.mark.parametrize("vocab_size", [0, 256, 300.0, "4096", True])
def test_bad_vocab_size_is_rejected(vocab_size):
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(["abc"], vocab_size)


def test_end_of_document_is_a_special_id_that_text_never_produces(stdlib_tokenizer):
    tok = stdlib_tokenizer
    assert tok.hf.id_to_token(tok.eod) == EOD_TOKEN
    # a document quoting the token's text (as tokenizer sources do) stays one document
    ids = tok.encode(f"x = '{EOD_TOKEN}'\n")
    assert tok.eod not in ids and tok.decode(ids) == f"x = '{EOD_TOKEN}'\n"


def test_save_load_round_trip(tmp_path, stdlib_tokenizer):
    stdlib_tokenizer.save(tmp_path)
    text = "def f(x):\n    return x ** 2  # ünïcödé ✓\n"
    for path in (tmp_path, tmp_path / "tokenizer.json"):
        loaded = CorpusTokenizer.load(path)
        assert loaded.encode(text) == stdlib_tokenizer.encode(text)
        assert (loaded.eod, loaded.vocab_size) == (stdlib_tokenizer.eod, stdlib_tokenizer.vocab_size)


def test_megatron_lms_huggingface_tokenizer_loads_it_and_encodes_the_same_ids(
    tmp_path, stdlib_docs, stdlib_tokenizer, monkeypatch
):
    """Megatron-LM's own ``build_tokenizer(--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR)``,
    from the release tag that pairs with the installed megatron-core (``../shared/megatron-lm``)."""
    import transformers  # noqa: F401  (the test extra installs it: Megatron's loader needs it)

    stdlib_tokenizer.save(tmp_path)
    monkeypatch.syspath_prepend(str(installed_tag()))
    for name in [m for m in sys.modules if m == "megatron.training" or m.startswith("megatron.training.")]:
        monkeypatch.delitem(sys.modules, name)
    from megatron.training.tokenizer.tokenizer import build_tokenizer

    args = argparse.Namespace(
        tokenizer_type="HuggingFaceTokenizer",
        tokenizer_model=str(tmp_path),
        rank=0,
        make_vocab_size_divisible_by=128,
        tensor_model_parallel_size=1,
        vocab_extra_ids=0,
        trust_remote_code=False,
        tokenizer_hf_include_special_tokens=False,
        tokenizer_hf_no_use_fast=False,
        legacy_tokenizer=True,
        vocab_size=None,
    )
    megatron = build_tokenizer(args)
    assert megatron.eod == stdlib_tokenizer.eod
    assert megatron.vocab_size == stdlib_tokenizer.vocab_size
    for doc in stdlib_docs.documents[40:50]:
        assert megatron.tokenize(doc.text) == stdlib_tokenizer.encode(doc.text)
        assert megatron.detokenize(stdlib_tokenizer.encode(doc.text)) == doc.text
