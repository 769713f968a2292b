"""``megatron-slim train`` on existing Megatron data: ``data.path`` + ``data.tokenizer`` pointing at
the very files a corpus run prepares trains exactly the same losses, and so does the corpus
tokenized with that tokenizer given as ``data.tokenizer``; a blend trains too."""

import pytest

from megatron_slim.megatron.data import prepare_corpus
from tests.train.test_train_job import _train

pytestmark = pytest.mark.multi  # train runs on their ranks

FAST = [
    "parallel.pp=1",
    "schedule.kind=1f1b",
    "schedule.num_slices=1",
    "train.iters=2",
    "train.global_batch_size=2",
    "model.seq_length=128",
    "train.warmup_iters=1",
]


def test_megatron_data_path_and_tokenizer_train_the_same_losses_as_the_corpus_they_came_from(tmp_path, data_cache):
    from_corpus = _train(tmp_path, "corpus", data_cache, *FAST)
    prepared = prepare_corpus("stdlib", cache_dir=data_cache, vocab_size=4096, max_files=60)
    from_path = _train(
        tmp_path, "path", data_cache, *FAST, f"data.path={prepared.path_prefix}", f"data.tokenizer={prepared.directory}"
    )
    assert from_path["losses"] == from_corpus["losses"]
    # the same tokenizer given for the corpus (tokenized afresh into its own cache entry): the same data again
    given = _train(tmp_path, "given", data_cache, *FAST, f"data.tokenizer={prepared.directory}")
    assert given["losses"] == from_corpus["losses"]
    blend = _train(
        tmp_path,
        "blend",
        data_cache,
        *FAST,
        f"data.path=0.5,{prepared.path_prefix},0.5,{prepared.path_prefix}",
        f"data.tokenizer={prepared.directory / 'tokenizer.json'}",
    )
    assert len(blend["losses"]) == 2 and all(0 < x < 10 for x in blend["losses"])
