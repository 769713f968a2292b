"""``data.path`` / ``data.tokenizer``: existing Megatron data (a prefix or a weighted blend) and the
tokenizer it was written with, checked before any work and read through megatron-core's datasets."""

import json
import shutil

import numpy
import pytest

from megatron_slim.megatron.data import build_gpt_dataset, write_token_documents
from megatron_slim.megatron.data.existing import load_tokenizer, parse_blend, prepare_megatron_data
from megatron_slim.megatron.launch.flags import recipe_to_megatron_args
from megatron_slim.plan.recipe import load_recipe
from megatron_slim.plan.schema import ConfigError
from tests.data.conftest import TINY_VOCAB


@pytest.fixture(scope="module")
def two_prefixes(tmp_path_factory, tiny_prepared):
    """Two datasets written with megatron-core's builder: ids 1..9 only, and ids 10..19 only."""
    root = tmp_path_factory.mktemp("megatron-data")
    rng = numpy.random.default_rng(0)
    for name, low in (("low", 1), ("high", 10)):
        docs = [
            rng.integers(low, low + 9, size=int(rng.integers(5, 40))).tolist() + [tiny_prepared.tokenizer.eod]
            for _ in range(200)
        ]
        write_token_documents(root / name, docs, TINY_VOCAB)
    tiny_prepared.tokenizer.save(root)
    return root


def test_parse_blend_normalises_weights_and_names_bad_items():
    assert parse_blend(("/d/a",)) == ((1.0, "/d/a"),)
    assert parse_blend(("1", "/d/a", "3", "/d/b")) == ((0.25, "/d/a"), (0.75, "/d/b"))
    for bad, field in (
        (("1", "/d/a", "/d/b"), "data.path: 3 item"),
        (("x", "/d/a", "1", "/d/b"), r"data.path\[0\]"),
        (("0", "/d/a", "1", "/d/b"), r"data.path\[0\]: weight"),
        (("1", "/d/a", "nan", "/d/b"), r"\[2\]"),
    ):
        with pytest.raises(ConfigError, match=field):
            parse_blend(bad)


def test_a_blend_draws_from_each_prefix_by_weight(two_prefixes, tiny_prepared):
    prepared = prepare_megatron_data(
        ("1", str(two_prefixes / "low"), "3", str(two_prefixes / "high")), str(two_prefixes), TINY_VOCAB
    )
    assert prepared.num_documents == 400 and prepared.tokenizer.eod == tiny_prepared.tokenizer.eod
    dataset = build_gpt_dataset(prepared, 16, 400, seed=3)
    high = sum(int(dataset[i]["tokens"][0]) >= 10 for i in range(len(dataset)))
    assert len(dataset) == 400 and abs(high / 400 - 0.75) < 0.05


@pytest.mark.parametrize("case", ["missing-idx", "foreign-idx", "no-tokenizer", "tokenizer-missing", "id-too-large"])
def test_bad_data_is_named_before_any_work(tmp_path, two_prefixes, case):
    prefix, tokenizer, vocab = str(tmp_path / "low"), str(two_prefixes), TINY_VOCAB
    for suffix in (".bin", ".idx"):
        shutil.copy(two_prefixes / f"low{suffix}", tmp_path / f"low{suffix}")
    expected = {
        "missing-idx": r"data.path\[0\]: .* has no .*low.idx",
        "foreign-idx": "not a megatron-core indexed",
        "no-tokenizer": "data.tokenizer: required",
        "tokenizer-missing": "data.tokenizer: no tokenizer",
        "id-too-large": rf"model.vocab_size: .* holds token id 400, past the embedding table "
        rf"\(got {TINY_VOCAB}",
    }[case]
    if case == "missing-idx":
        (tmp_path / "low.idx").unlink()
    elif case == "foreign-idx":
        (tmp_path / "low.idx").write_bytes(b"not an index" * 10)
    elif case == "no-tokenizer":
        tokenizer = ""
    elif case == "tokenizer-missing":
        tokenizer = str(tmp_path / "nowhere")
    else:
        write_token_documents(tmp_path / "low", [[1, 2, 400], [3, 0]], 1000)  # an id past model.vocab_size
    with pytest.raises(ConfigError, match=expected):
        prepare_megatron_data((prefix,), tokenizer, vocab)


def test_a_tokenizer_larger_than_the_model_vocabulary_is_refused(two_prefixes):
    with pytest.raises(ConfigError, match=rf"model.vocab_size: 100 is smaller .*allowed: an integer >= {TINY_VOCAB}"):
        load_tokenizer(str(two_prefixes), 100)
    with pytest.raises(ConfigError, match="data.tokenizer: .* does not load"):
        bad = two_prefixes / "broken"
        bad.mkdir(exist_ok=True)
        (bad / "tokenizer.json").write_text(json.dumps({"not": "a tokenizer"}))
        load_tokenizer(str(bad), 4096)


def test_recipe_fields_and_the_megatron_flags_they_stand_for(tmp_path):
    recipe = load_recipe(
        "tiny-cpu",
        ["data.path=0.3,/d/a_text_document,0.7,/d/b_text_document", f"data.tokenizer={tmp_path}/tokenizer.json"],
    )
    flags = recipe_to_megatron_args(recipe)
    at = flags.index("--data-path")
    assert flags[at + 1 : at + 5] == ["0.3", "/d/a_text_document", "0.7", "/d/b_text_document"]
    at = flags.index("--tokenizer-type")
    assert flags[at : at + 4] == ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path)]
    assert "--data-path" not in recipe_to_megatron_args(load_recipe("tiny-cpu"))
    with pytest.raises(ConfigError, match="data.corpus: '/x' with data.path"):
        load_recipe("tiny-cpu", ["data.path=/d/a", "data.corpus=/x"])
