"""``megatron-slim simulate --packing``: the JSON it writes and the flags it refuses."""

import json

import pytest

from megatron_slim.cli import main

BASE = ["simulate", "--recipe", "tiny-cpu", "--set", "parallel.dp=2", "parallel.pp=2"]
LENGTHS = ["--lengths", "uniform:min=16,max=900"]
KEYS = {"iteration_time_s", "tokens_per_s", "mfu", "padding_share", "fwd_imbalance", "bwd_imbalance"}


def test_every_method_writes_its_metrics_under_packing(tmp_path, capsys):
    out = tmp_path / "pack.json"
    argv = [*BASE, *LENGTHS, "--packing", "all", "--micropack-tokens", "256", "--seed", "3", "--json", str(out)]
    assert main(argv) == 0
    payload = json.loads(out.read_text())
    methods = ["slimpack", "megatron", "bfd", "lpfhp", "hybrid_cp", "wlb"]
    assert list(payload["packing"]) == methods
    for row in payload["packing"].values():
        assert KEYS | {"peak_memory_bytes"} <= set(row)
        assert row["iteration_time_s"] > 0 and row["fwd_imbalance"] >= 1.0 and row["peak_memory_bytes"] > 0
        assert row["tokens_per_s"] == pytest.approx(payload["tokens"] / row["iteration_time_s"])
    assert payload["tokens"] == 8 * 512 and payload["micropack_tokens"] == 256 and payload["seed"] == 3
    table = capsys.readouterr().out
    assert all(m in table for m in methods) and "vs megatron" in table


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--packing", "slimpack,zip", *LENGTHS], "--packing 'slimpack,zip': allowed: 'all' or a comma list"),
        (["--packing", "slimpack"], "--lengths: required with --packing"),
        (["--packing", "megatron", *LENGTHS, "--cp-engine", "ring"], "--cp-engine: not available with --packing"),
        (["--packing", "megatron", *LENGTHS, "--dynamic", "freeze"], "--dynamic: not available with --packing"),
        (["--packing", "megatron", *LENGTHS, "--compare", "1f1b"], "--compare: not available with --packing"),
        (["--packing", "megatron", *LENGTHS, "--trace", "t.json"], "--trace: not available with --packing"),
        (["--packing", "megatron", *LENGTHS, "--plot", "p.png"], "--plot: not available with --packing"),
        (["--packing", "megatron", *LENGTHS, "--micropack-tokens", "0"], "--micropack-tokens 0: allowed"),
        (["--micropack-tokens", "64"], "--micropack-tokens: only with --packing"),
    ],
)
def test_flags_that_do_not_apply_are_refused_naming_what_is_allowed(extra, needle, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main([*BASE, *extra]) == 2
    assert needle in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # refused before any output was written
