"""``megatron-slim train`` with ``data.packing``: real documents of varying length packed per iteration.

* ``none`` is today's run (GPTDataset windows), unchanged.
* The windows (``train/packed.py``) hold every document token of the iteration exactly once, with
  labels = the next token of its own document and positions restarting per sample; the loss weights
  make the gradient the per-token mean over the whole global batch, whatever the microbatch counts.
* slimpack and megatron runs on the same documents see the same documents each iteration and, as
  slice attention keeps to each document (``document_lengths``), the same losses.
"""

import random

import pytest
import torch

from megatron_slim.plan.pack.training import iteration_samples
from megatron_slim.plan.recipe import load_recipe
from megatron_slim.train.packed import PackedData
from tests.train.conftest import cut_documents
from tests.train.test_train_job import _train

SEQ = 128
FAST = [
    "model.seq_length=128",
    "train.global_batch_size=4",
    "train.iters=3",
    "train.warmup_iters=1",
    "schedule.num_slices=4",
]
LAYOUTS = {"pp1-dp2": ["parallel.pp=1", "parallel.dp=2"], "pp2": ["parallel.pp=2"]}
# the default tier packs at pp2; packing over data-parallel replicas runs there in
# tests/train/test_train_packing_dp_merge.py, and at pp1 x dp2 here in the slow tier
LAYOUT_PARAMS = [pytest.param(k, marks=pytest.mark.slow) if k == "pp1-dp2" else k for k in LAYOUTS]


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory):
    """A corpus of documents from 20 to 1500 characters (a few tokens to a few windows), cut from stdlib
    modules, so windows pack several documents and some documents are cut into samples."""
    return cut_documents(tmp_path_factory.mktemp("packing-docs"), 1, [20, 60, 150, 300, 600, 1500], 240)


def _documents(seed=0, count=60):
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    return [
        torch.randint(2, 4096, (rng.choice([3, 40, 90, 128, 200, 333]),), generator=g).numpy() for _ in range(count)
    ]


@pytest.mark.parametrize("method", ["slimpack", "megatron", "bfd"])
@pytest.mark.parametrize("dp", [1, 2])
def test_windows_train_every_document_token_once_with_global_per_token_weights(method, dp):
    recipe = load_recipe("tiny-cpu", [f"data.packing={method}", f"model.seq_length={SEQ}", "parallel.pp=1"])
    docs = _documents()
    data = PackedData(recipe, docs, dp)
    for it in range(3):
        packing = data.iteration(it)
        ranks = [data.batches(packing, r) for r in range(dp)]
        got: list[list[int]] = []
        weight_sum = 0.0
        for batches in ranks:
            for b in batches:
                tokens, mask = b["tokens"][0], b["loss_mask"][0]
                positions = b["position_ids"][0]
                assert tokens.shape == (SEQ,) and sum(b["document_lengths"]) == SEQ
                at = 0
                for n in b["document_lengths"]:
                    assert positions[at : at + n].tolist() == list(range(n))
                    got.append(tokens[at : at + n].tolist())
                    at += n
                # the schedule divides by the window's tokens and this rank's microbatches, DP averages
                weight_sum += b["loss_weight"] / (max(1.0, float(mask.sum())) * len(batches) * dp) * float(mask.sum())
        taken = [data.samples[i] for i in iteration_samples(data.sample_lengths, 8 * SEQ, it)]
        want = [data.documents[s.document][s.offset : s.offset + s.length].tolist() for s in taken]
        assert sorted(g for g in got if any(g)) == sorted(want)  # the other segments are padding (zeros)
        assert weight_sum == pytest.approx(1.0)  # sum over loss tokens of d(loss)/d(token loss) = 1
        assert packing.loss_tokens == sum(len(w) - 1 if s.last else len(w) for s, w in zip(taken, want))
        # labels: the next token of the same document (past a cut sample's end too), masked at its end
        for r, batches in enumerate(ranks):
            for window, b in zip(packing.windows[r], batches):
                at = 0
                for p in window.pieces:
                    s = packing.samples[p.sample]
                    doc = data.documents[s.document]
                    begin = s.offset + p.start
                    want_labels = doc[begin + 1 : begin + p.length + 1].tolist()
                    assert b["labels"][0, at : at + len(want_labels)].tolist() == want_labels
                    assert b["loss_mask"][0, at : at + p.length].sum() == len(want_labels)
                    at += p.length


def _runs(tmp_path_factory, data_cache, corpus, layout):
    out = tmp_path_factory.mktemp(f"packing-{layout}")
    sets = [*FAST, *LAYOUTS[layout], f"data.corpus={corpus}"]
    return {m: _train(out, m, data_cache, *sets, f"data.packing={m}") for m in ("slimpack", "megatron")}


@pytest.fixture(scope="module", params=LAYOUT_PARAMS)
def method_runs(request, tmp_path_factory, data_cache, short_documents):
    return _runs(tmp_path_factory, data_cache, short_documents, request.param)


@pytest.mark.multi
def test_slimpack_and_megatron_pack_the_same_documents_each_iteration(method_runs):
    slim, mega = method_runs["slimpack"], method_runs["megatron"]
    assert len(slim["packing"]) == len(mega["packing"]) == 3
    for a, b in zip(slim["packing"], mega["packing"]):
        assert (a["method"], b["method"]) == ("slimpack", "megatron")
        assert a["document_tokens"] == b["document_tokens"] and a["loss_tokens"] == b["loss_tokens"]
        for rec in (a, b):
            slots = SEQ * sum(rec["microbatches"])
            assert rec["padding_share"] == pytest.approx(1 - rec["document_tokens"] / slots)
    assert all(0 < x < 10 for x in slim["losses"] + mega["losses"])


@pytest.mark.multi
def test_slimpack_and_megatron_give_equal_losses(method_runs):
    """Each document's token losses do not depend on its window once attention keeps to documents."""
    assert method_runs["slimpack"]["losses"] == pytest.approx(method_runs["megatron"]["losses"], rel=1e-5, abs=0)


@pytest.mark.multi
@pytest.mark.slow  # default tier: test_train_data.py and the resume runs read GPTDataset windows
def test_packing_none_is_the_gpt_dataset_run(tmp_path, data_cache):
    sets = [*FAST, "parallel.pp=2", "train.iters=2"]
    default = _train(tmp_path, "default", data_cache, *sets)
    none = _train(tmp_path, "none", data_cache, *sets, "data.packing=none")
    assert "packing" not in none and none["losses"] == default["losses"]
    assert none["tokens_per_s"] == pytest.approx(4 * SEQ * 2 / sum(none["iteration_time_s"]))


@pytest.mark.slow
@pytest.mark.multi
def test_slimpack_trains_pp2_cp2_to_the_losses_of_pp1_cp1(tmp_path, data_cache, short_documents):
    """Packed windows under context parallelism: SlimPipe's query-out CP attention (no cp.engine)
    splits every slice over the CP ranks and keeps to each window's documents across slices."""
    sets = [*FAST, f"data.corpus={short_documents}", "data.packing=slimpack"]
    split = _train(tmp_path, "pp2-cp2", data_cache, *sets, "parallel.pp=2", "parallel.cp=2")
    flat = _train(tmp_path, "pp1-cp1", data_cache, *sets, "parallel.pp=1")
    assert [r["document_tokens"] for r in split["packing"]] == [r["document_tokens"] for r in flat["packing"]]
    assert len(split["losses"]) == 3 and split["losses"] != flat["losses"][:1] * 3
    assert split["cp"] == {"size": 2, "engine": None, "attention": "slimpipe-query-out", "document_masking": True}
    assert split["losses"] == pytest.approx(flat["losses"], rel=1e-5, abs=0)


@pytest.mark.slow
@pytest.mark.multi
def test_slimpack_trains_tp2_to_the_losses_of_tp1(tmp_path, data_cache, short_documents):
    """Packed windows under tensor parallelism: every TP rank reads its own windows and
    their documents, so the run equals the tp=1 one up to summation order."""
    sets = [*FAST, f"data.corpus={short_documents}", "data.packing=slimpack", "parallel.pp=1"]
    split = _train(tmp_path, "tp2", data_cache, *sets, "parallel.tp=2")
    flat = _train(tmp_path, "tp1", data_cache, *sets)
    assert [r["document_tokens"] for r in split["packing"]] == [r["document_tokens"] for r in flat["packing"]]
    assert len(split["losses"]) == 3
    assert split["losses"] == pytest.approx(flat["losses"], rel=1e-5, abs=0)


@pytest.mark.slow
@pytest.mark.multi
def test_slimpack_cp_routes_train_to_the_losses_of_cp1(tmp_path, data_cache, short_documents):
    """``cp.engine: zeppelin``: the outliers SlimPack CP-routes run under Zeppelin's placement in the
    training loop itself (``train/packed_routes.py``); the losses equal the cp=1 run's."""
    sets = [*FAST, f"data.corpus={short_documents}", "data.packing=slimpack", "parallel.pp=1", "parallel.dp=2"]
    routed = _train(tmp_path, "routes", data_cache, *sets, "parallel.cp=2", "cp.engine=zeppelin")
    flat = _train(tmp_path, "cp1", data_cache, *sets)
    assert routed["cp"]["engine"] == "zeppelin" and routed["cp"]["cp_routes"]
    assert any(r["cp_routed"] for r in routed["packing"]) and "cp_routed" not in flat["packing"][0]
    assert [r["document_tokens"] for r in routed["packing"]] == [r["document_tokens"] for r in flat["packing"]]
    assert routed["losses"] == pytest.approx(flat["losses"], rel=1e-5, abs=0)


@pytest.mark.slow
@pytest.mark.multi
def test_slimpack_dp_merge_trains_to_the_losses_of_dp1(tmp_path, data_cache, short_documents):
    """pp=1 SlimPipe over dp=2: SlimPack splits outliers over both replicas (head K/V sent to the tail,
    dK/dV back, ``runtime/pipeline/dp_merge.py``) inside the training loop; the losses equal dp=1's."""
    sets = [
        *FAST,
        f"data.corpus={short_documents}",
        "data.packing=slimpack",
        "parallel.pp=1",
        "train.global_batch_size=2",
    ]
    merged = _train(tmp_path, "dp2", data_cache, *sets, "parallel.dp=2")
    flat = _train(tmp_path, "dp1", data_cache, *sets, "parallel.dp=1")
    assert any(r.get("dp_merged") for r in merged["packing"]) and "dp_merged" not in flat["packing"][0]
    assert [r["document_tokens"] for r in merged["packing"]] == [r["document_tokens"] for r in flat["packing"]]
    assert merged["losses"] == pytest.approx(flat["losses"], rel=1e-5, abs=0)
