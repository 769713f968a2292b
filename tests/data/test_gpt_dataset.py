import pickle

import numpy
import pytest
import torch

from megatron_slim.megatron.data import build_gpt_dataset, prepare_corpus, read_token_documents
from megatron_slim.runtime.spawn import run_ranks
from tests.data import _spawn_fns

SEQ = 64


def _token_stream(prepared, dataset) -> numpy.ndarray:
    """All tokens in the dataset's (shuffled, possibly repeated) document order."""
    docs = read_token_documents(prepared.path_prefix)
    return numpy.concatenate([docs[d] for d in dataset.document_index])


def test_samples_have_megatron_batch_fields(tiny_prepared):
    dataset = build_gpt_dataset(tiny_prepared, SEQ, num_samples=100, seed=0)
    assert len(dataset) >= 100
    sample = dataset[0]
    assert set(sample) == {"tokens", "labels", "loss_mask", "position_ids"}
    for name, dtype in [
        ("tokens", torch.int64),
        ("labels", torch.int64),
        ("loss_mask", torch.float32),
        ("position_ids", torch.int64),
    ]:
        assert sample[name].shape == (SEQ,) and sample[name].dtype == dtype
        assert sample[name].device.type == "cpu"
    assert torch.equal(sample["position_ids"], torch.arange(SEQ))


def test_samples_are_consecutive_windows_of_the_token_stream(tiny_prepared):
    dataset = build_gpt_dataset(tiny_prepared, SEQ, num_samples=None, seed=5)
    stream = torch.from_numpy(_token_stream(tiny_prepared, dataset))
    assert len(dataset) == (len(stream) - 1) // SEQ
    for i in range(0, len(dataset), 7):
        sample = dataset[i]
        start = int(dataset.shuffle_index[i]) * SEQ
        assert torch.equal(sample["tokens"], stream[start : start + SEQ])
        assert torch.equal(sample["labels"], stream[start + 1 : start + SEQ + 1])
        assert torch.equal(sample["tokens"][1:], sample["labels"][:-1])
        assert torch.equal(sample["loss_mask"], torch.ones(SEQ))
        assert int(sample["tokens"].max()) < tiny_prepared.vocab_size


def test_eod_loss_masking_is_opt_in_and_exact(tiny_prepared):
    eod = tiny_prepared.tokenizer.eod
    dataset = build_gpt_dataset(tiny_prepared, SEQ, num_samples=None, seed=0, eod_mask_loss=True)
    hits = 0
    for i in range(len(dataset)):
        sample = dataset[i]
        is_eod = sample["tokens"] == eod
        hits += int(is_eod.any())
        assert torch.equal(sample["loss_mask"], (~is_eod).float())
    assert hits > 0


def test_attention_mask_is_opt_in_and_causal(tiny_prepared):
    dataset = build_gpt_dataset(tiny_prepared, SEQ, num_samples=4, create_attention_mask=True)
    mask = dataset[0]["attention_mask"]
    assert mask.shape == (1, SEQ, SEQ) and mask.dtype == torch.bool
    assert torch.equal(mask[0], torch.ones(SEQ, SEQ).triu(1).bool())  # True = masked out


def test_same_seed_same_samples_other_seed_other_order(tiny_prepared):
    def first_tokens(seed):
        dataset = build_gpt_dataset(tiny_prepared, SEQ, num_samples=20, seed=seed)
        return [dataset[i]["tokens"].tolist() for i in range(20)]

    assert first_tokens(11) == first_tokens(11)
    assert first_tokens(11) != first_tokens(12)


def test_dataset_survives_pickling_for_loader_workers(tiny_prepared):
    dataset = build_gpt_dataset(tiny_prepared, SEQ, num_samples=10, seed=2)
    copy = pickle.loads(pickle.dumps(dataset))
    text = "def f(x):\n    return x  # ünïcödé\n"
    assert copy.config.tokenizer.encode(text) == tiny_prepared.tokenizer.encode(text)
    for i in range(10):
        assert all(torch.equal(copy[i][k], dataset[i][k]) for k in dataset[i])


def test_more_samples_than_one_epoch_repeat_the_corpus(tiny_prepared):
    epoch = len(build_gpt_dataset(tiny_prepared, SEQ, num_samples=None))
    dataset = build_gpt_dataset(tiny_prepared, SEQ, num_samples=3 * epoch + 1)
    assert len(dataset) >= 3 * epoch + 1
    assert dataset[len(dataset) - 1]["tokens"].shape == (SEQ,)


@pytest.mark.parametrize(
    "kwargs, name", [({"seq_length": 0}, "seq_length"), ({"num_samples": 0}, "num_samples"), ({"seed": -1}, "seed")]
)
def test_bad_arguments_are_rejected(tiny_prepared, kwargs, name):
    args = {"seq_length": SEQ, "num_samples": 10, "seed": 0, **kwargs}
    with pytest.raises(ValueError, match=name):
        build_gpt_dataset(tiny_prepared, **args)


def test_sequence_longer_than_the_corpus_is_rejected(tmp_path):
    corpus_dir = tmp_path / "t"
    corpus_dir.mkdir()
    (corpus_dir / "a.txt").write_text("short\n")
    prepared = prepare_corpus(corpus_dir, cache_dir=tmp_path / "c", vocab_size=260)
    with pytest.raises(ValueError, match="seq_length"):
        build_gpt_dataset(prepared, 1000, num_samples=None)


def test_gloo_ranks_share_one_build_and_see_identical_samples(tmp_path):
    cache = str(tmp_path / "cache")
    results = run_ranks(_spawn_fns.prepare_and_sample, 2, cache, 280, 8, 32, timeout_s=300)
    assert sorted(hit for hit, _ in results) == [False, True]  # one rank built, one waited
    reference = build_gpt_dataset(
        prepare_corpus("stdlib", cache_dir=cache, vocab_size=280, max_files=8), 32, num_samples=50, seed=3
    )
    expected = [reference[i]["tokens"].tolist() for i in range(len(reference))]
    assert results[0][1] == results[1][1] == expected
