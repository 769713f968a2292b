import pytest

from megatron_slim.megatron.data import prepare_corpus
from tests.conftest import session_dir

TINY_VOCAB = 300
TINY_FILES = 20


@pytest.fixture(scope="session")
def tiny_cache_dir(tmp_path_factory):
    return session_dir(tmp_path_factory, "megatron-slim-cache")


@pytest.fixture(scope="session")
def tiny_prepared(tiny_cache_dir):
    """The first 20 stdlib files with a 300-token vocabulary, shared by the read-only tests."""
    return prepare_corpus("stdlib", cache_dir=tiny_cache_dir, vocab_size=TINY_VOCAB, max_files=TINY_FILES)
