import numpy
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_slim.megatron.data import read_token_documents, write_token_documents, write_tokenized_corpus
from megatron_slim.megatron.data.indexed import token_dtype


def test_documents_read_back_unchanged(tmp_path):
    docs = [[1, 2, 3], [4], list(range(300, 1300))]
    stats = write_token_documents(tmp_path / "d", docs, vocab_size=2000)
    assert (stats.num_documents, stats.num_tokens) == (3, 1004)
    assert [d.tolist() for d in read_token_documents(tmp_path / "d")] == docs
    dataset = IndexedDataset(str(tmp_path / "d"))
    assert dataset.index.dtype == numpy.uint16
    assert dataset.sequence_lengths.tolist() == [3, 1, 1000]
    assert dataset.document_indices.tolist() == [0, 1, 2, 3]


def test_large_vocab_uses_int32(tmp_path):
    assert token_dtype(65536) == numpy.uint16 and token_dtype(65537) == numpy.int32
    write_token_documents(tmp_path / "d", [[70000, 1]], vocab_size=70001)
    assert [d.tolist() for d in read_token_documents(tmp_path / "d")] == [[70000, 1]]


def test_empty_document_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="document #1"):
        write_token_documents(tmp_path / "d", [[1], []], vocab_size=10)


def test_tokenized_corpus_equals_encoded_texts_plus_eod(tmp_path, tiny_prepared):
    tok = tiny_prepared.tokenizer
    texts = ["print('hi')\n", "ünïcödé ✓", "x"]
    stats = write_tokenized_corpus(tmp_path / "t", texts, tok)
    back = read_token_documents(tmp_path / "t")
    assert [d.tolist() for d in back] == [tok.encode(t) + [tok.eod] for t in texts]
    assert stats.num_tokens == sum(len(d) for d in back)
    assert [tok.decode(d.tolist()) for d in back] == texts
