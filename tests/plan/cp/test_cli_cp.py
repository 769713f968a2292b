import json

import pytest

from megatron_slim.cli import main
from megatron_slim.plan.cp.engines import ENGINES

SMALL = ["--set", "train.global_batch_size=1"]
SPEC = "lognormal:mean=4096,sigma=1.2,min=256,max=65536"


@pytest.mark.parametrize("engine", ENGINES)
def test_each_engine_writes_json(engine, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["simulate", "--recipe", "zeppelin-7b-h800", "--cp-engine", engine, "--lengths", SPEC,
                 "--seed", "3", "--json", str(out), *SMALL]) == 0
    data = json.loads(out.read_text())
    assert data["engine"] == engine and data["seed"] == 3 and data["lengths"] == SPEC
    assert data["num_packs"] == 1 and data["tokens"] == 262144 and sum(data["pack_lengths"][0]) == 262144
    assert data["iteration_time_s"] > 0 and data["tokens_per_s"] > 0 and 0 < data["mfu"] < 1
    assert len(data["ranks"]) == 32 and {"attention_s", "linear_s", "idle_s", "comm_s"} <= set(data["ranks"][0])
    pack = data["packs"][0]
    assert len(pack["digest"]) == 64 and pack["time_s"] == pytest.approx(
        32 * (pack["forward_layer_s"] + pack["backward_layer_s"]))
    assert data["remap"] is (engine == "zeppelin")
    assert engine in capsys.readouterr().out


def test_all_engines_side_by_side_to_stdout(capsys):
    assert main(["simulate", "--recipe", "zeppelin-7b-h800", "--cp-engine", "all", "--lengths", SPEC,
                 "--json", "-", *SMALL]) == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert [r["engine"] for r in data["results"]] == list(ENGINES)
    assert "vs ring" in captured.err and "zeppelin +remap" in captured.err
    by = {r["engine"]: r for r in data["results"]}
    assert by["zeppelin"]["iteration_time_s"] < by["ring"]["iteration_time_s"]


def test_recipe_engine_is_the_default_and_a_file_works(tmp_path, capsys):
    lengths = tmp_path / "l.txt"
    lengths.write_text("\n".join(["4096"] * 8) + "\n")
    assert main(["simulate", "--recipe", "zeppelin-7b-h800", "--lengths", str(lengths), *SMALL,
                 "--set", "cp.engine=dynamic", "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["engine"] == "dynamic" and set(data["pack_lengths"][0]) == {4096}


@pytest.mark.parametrize("argv,needle", [
    (["--cp-engine", "ring,foo", "--lengths", SPEC], "--cp-engine: invalid value (got 'foo'"),
    (["--cp-engine", "ring"], "--lengths: required"),
    (["--cp-engine", "ring", "--lengths", "lognormal:mean=1"], "lognormal.sigma: missing key"),
    (["--cp-engine", "ulysses", "--lengths", SPEC, "--set", "model.num_attention_heads=16",
      "model.num_query_groups=16"], "num_attention_heads=16"),
    (["--cp-engine", "ring", "--lengths", SPEC, "--set", "parallel.pp=2"], "parallel.pp: invalid value"),
    (["--cp-engine", "ring", "--lengths", SPEC, "--set", "parallel.dp=2", "train.global_batch_size=2"],
     "parallel.dp: invalid value"),
    (["--cp-engine", "ring", "--lengths", SPEC, "--compare", "1f1b"], "--compare"),
])
def test_user_errors_exit_2_naming_the_input(argv, needle, capsys):
    assert main(["simulate", "--recipe", "zeppelin-7b-h800", *argv]) == 2
    assert needle in capsys.readouterr().err
