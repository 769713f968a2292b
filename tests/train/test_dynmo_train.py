"""``megatron-slim train --dynmo-*`` on gloo ranks: a pipelined, sliced run (pp=2, 2 slices) with
freezing, early exit, pruning and profiling reproduces the unpipelined run's losses; the profile covers the
whole model on the reporting rank."""

import json

import pytest

from megatron_slim.cli import main
from tests.oracle.reference import UNPIPELINED_UNSLICED
from tests.overrides import once_per_key
from tests.train.conftest import SMALL_DATA

pytestmark = pytest.mark.multi

SETS = ("train.iters=3", "train.global_batch_size=2", "model.seq_length=128")
FLAGS = (
    *("--dynmo-profile", "--dynmo-freeze", "2:0-2", "--dynmo-exit-threshold", "0.05", "--dynmo-exit-from-layer", "3"),
    *("--dynmo-prune", "2-3:0.5"),
)


def _train(tmp_path, name, data_cache, *sets):
    out = tmp_path / f"{name}.json"
    argv = [
        "train",
        "--set",
        *once_per_key(f"data.cache_dir={data_cache}", *SMALL_DATA, *SETS, *sets),
        "--json",
        str(out),
        *FLAGS,
    ]
    assert main(argv) == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    tmp = tmp_path_factory.mktemp("dynmo")
    piped = _train(tmp, "pp2", data_cache, "parallel.pp=2", "schedule.kind=slimpipe", "schedule.num_slices=2")
    return piped, _train(tmp, "pp1", data_cache, *UNPIPELINED_UNSLICED)


def test_pipelined_sliced_run_reproduces_the_unpipelined_losses(runs):
    piped, whole = runs
    assert len(piped["losses"]) == 3
    assert piped["losses"] == pytest.approx(whole["losses"], rel=1e-6)


def test_dynmo_section_reports_profile_frozen_layers_and_exits(runs):
    piped, whole = runs
    for run in runs:
        d = run["dynmo"]
        assert d["frozen_layers"] == [0, 1, 2]
        assert [p["layer"] for p in d["layer_profile"]] == list(range(8))  # gathered over pipeline ranks
        assert all(p["forward_s"] > 0 and p["backward_s"] > 0 for p in d["layer_profile"])
        assert all(p["gradient_bytes"] == 0 for p in d["layer_profile"][:3])
        assert all(p["gradient_bytes"] == p["parameter_bytes"] > 0 for p in d["layer_profile"][3:])
        assert sorted(d["active_token_share"]) == [str(i) for i in range(3, 8)]
        assert 0 < d["active_token_share"]["3"] < 1
        assert d["kept_neuron_share"] == {str(i): 176 / 352 for i in range(8)}  # tiny-cpu: ffn 352
    assert piped["dynmo"]["active_token_share"] == pytest.approx(whole["dynmo"]["active_token_share"])
