import json
import shutil

import pytest

from megatron_slim.data import list_corpus
from megatron_slim.megatron.data import dataset as dataset_module
from megatron_slim.megatron.data import prepare_corpus, read_token_documents
from tests.data.conftest import TINY_FILES, TINY_VOCAB


def test_prepared_corpus_holds_every_document_encoded(tiny_prepared):
    tok = tiny_prepared.tokenizer
    corpus = list_corpus("stdlib", max_files=TINY_FILES)
    docs = read_token_documents(tiny_prepared.path_prefix)
    assert tiny_prepared.num_documents == len(docs) == TINY_FILES
    assert [d.tolist() for d in docs] == [tok.encode(t) + [tok.eod] for t in corpus.texts()]
    assert tiny_prepared.num_tokens == sum(len(d) for d in docs)
    assert tiny_prepared.num_bytes == corpus.num_bytes
    assert tiny_prepared.vocab_size == TINY_VOCAB
    assert tiny_prepared.corpus_fingerprint == corpus.fingerprint


def test_second_call_is_a_cache_hit_with_the_same_result(tiny_cache_dir, tiny_prepared):
    again = prepare_corpus("stdlib", cache_dir=tiny_cache_dir, vocab_size=TINY_VOCAB, max_files=TINY_FILES)
    assert again.cache_hit
    assert again.path_prefix == tiny_prepared.path_prefix
    assert again.tokenizer.hf.to_str() == tiny_prepared.tokenizer.hf.to_str()
    assert (again.num_documents, again.num_tokens) == (tiny_prepared.num_documents, tiny_prepared.num_tokens)
    meta = json.loads((again.directory / "meta.json").read_text())
    assert meta["num_tokens"] == again.num_tokens
    assert not list(again.directory.parent.glob(".*staging*"))


def test_settings_and_content_pick_distinct_entries(tmp_path):
    corpus_dir = tmp_path / "texts"
    corpus_dir.mkdir()
    (corpus_dir / "a.txt").write_text("hello world, hello tokens\n" * 20)
    first = prepare_corpus(corpus_dir, cache_dir=tmp_path / "c", vocab_size=270)
    other_vocab = prepare_corpus(corpus_dir, cache_dir=tmp_path / "c", vocab_size=280)
    (corpus_dir / "a.txt").write_text("different words entirely\n" * 20)
    other_text = prepare_corpus(corpus_dir, cache_dir=tmp_path / "c", vocab_size=270)
    assert not any(p.cache_hit for p in (first, other_vocab, other_text))
    assert len({first.directory, other_vocab.directory, other_text.directory}) == 3
    assert first.directory.name.startswith("texts-")


def test_failed_build_publishes_nothing_and_stale_staging_is_cleared(tmp_path, monkeypatch):
    corpus_dir = tmp_path / "texts"
    corpus_dir.mkdir()
    (corpus_dir / "a.txt").write_text("some text to tokenize\n")
    cache = tmp_path / "c"

    def fail(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(dataset_module, "write_tokenized_corpus", fail)
    with pytest.raises(RuntimeError, match="disk full"):
        prepare_corpus(corpus_dir, cache_dir=cache, vocab_size=260)
    assert [p.name for p in (cache / "corpora").iterdir() if not p.name.endswith(".lock")] == []
    monkeypatch.undo()

    # A process killed mid-build leaves its staging directory behind; the next build clears it.
    prepared = prepare_corpus(corpus_dir, cache_dir=cache, vocab_size=260)
    shutil.rmtree(prepared.directory)
    stale = prepared.directory.parent / f".{prepared.directory.name}.staging-1-dead"
    stale.mkdir()
    (stale / "tokens.bin").write_bytes(b"half")
    rebuilt = prepare_corpus(corpus_dir, cache_dir=cache, vocab_size=260)
    assert not rebuilt.cache_hit and not stale.exists()
    assert read_token_documents(rebuilt.path_prefix)[0][-1] == rebuilt.tokenizer.eod


def test_cache_dir_defaults_to_the_environment_variable(tmp_path, monkeypatch):
    corpus_dir = tmp_path / "texts"
    corpus_dir.mkdir()
    (corpus_dir / "a.txt").write_text("env var cache\n")
    monkeypatch.setenv("MEGATRON_SLIM_CACHE", str(tmp_path / "env-cache"))
    prepared = prepare_corpus(corpus_dir, vocab_size=260)
    assert prepared.directory.parent == tmp_path / "env-cache" / "corpora"


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"vocab_size": 10}, "vocab_size"),
        ({"max_files": -2}, "max_files"),
        ({"tokenizer_train_bytes": 0}, "tokenizer_train_bytes"),
    ],
)
def test_bad_settings_are_rejected(tmp_path, kwargs, name):
    with pytest.raises(ValueError, match=name):
        prepare_corpus("stdlib", cache_dir=tmp_path, **kwargs)


def _damage(entry, how):
    if how == "truncated-bin":
        data = (entry / "tokens.bin").read_bytes()
        (entry / "tokens.bin").write_bytes(data[: len(data) // 2])
    elif how == "zeroed-bin":  # same size: only the checksum sees it
        (entry / "tokens.bin").write_bytes(bytes((entry / "tokens.bin").stat().st_size))
    elif how == "truncated-idx":
        data = (entry / "tokens.idx").read_bytes()
        (entry / "tokens.idx").write_bytes(data[:-8])
    elif how == "broken-tokenizer":
        (entry / "tokenizer.json").write_text("{ not json")
    elif how == "broken-metadata":
        (entry / "meta.json").write_text("{ not json")


@pytest.mark.parametrize(
    "how,reason",
    [
        ("truncated-bin", "tokens.bin has"),
        ("zeroed-bin", "tokens.bin does not match the checksum"),
        ("truncated-idx", "tokens.idx has"),
        ("broken-tokenizer", "tokenizer.json"),
        ("broken-metadata", "meta.json unreadable"),
    ],
)
def test_a_damaged_cache_entry_is_found_and_built_again(tmp_path, capsys, how, reason):
    """A truncated or zeroed token file, a broken tokenizer or metadata: the next run says so in one
    line and builds the entry again, instead of a traceback or training on garbage."""
    corpus = tmp_path / "texts"
    corpus.mkdir()
    (corpus / "a.txt").write_text("hello world, hello tokens\n" * 40)
    first = prepare_corpus(corpus, cache_dir=tmp_path / "c", vocab_size=270)
    tokens = [d.tolist() for d in read_token_documents(first.path_prefix)]
    capsys.readouterr()
    _damage(first.directory, how)
    again = prepare_corpus(corpus, cache_dir=tmp_path / "c", vocab_size=270)
    out = capsys.readouterr().out
    assert (
        f"data: the cache entry {first.directory} is damaged (" in out and reason in out and "building it again" in out
    )
    assert not again.cache_hit and again.directory == first.directory
    assert [d.tolist() for d in read_token_documents(again.path_prefix)] == tokens
    assert prepare_corpus(corpus, cache_dir=tmp_path / "c", vocab_size=270).cache_hit
