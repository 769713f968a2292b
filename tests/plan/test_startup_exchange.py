"""Context exchange at start-up: ``megatron-slim train`` and the Megatron-LM launcher run
``exchange`` (uniform slices plus context exchange; the launcher with any vpp and tp, query-out CP,
full or selective recomputation), each refusing by name what it does not run it with;
``megatron-args`` emits the flag for the launcher (train's own rules: ``test_startup_rules_exchange.py``)."""

import argparse

import pytest

from megatron_slim.megatron.launch.args import settings_from_megatron_args
from megatron_slim.megatron.launch.flags import check_megatron_args, recipe_to_megatron_args
from megatron_slim.plan.recipe import load_recipe
from megatron_slim.plan.schema import ConfigError
from megatron_slim.plan.startup import LAUNCHER, broken_rule
from megatron_slim.train.checks import check_trainable
from tests.plan.test_startup_rules import FLAGS, SLIMPIPE_FLAGS

EXCHANGE = {**FLAGS, **SLIMPIPE_FLAGS, "slimpipe_slice_policy": "exchange", "pipeline_model_parallel_size": 2}


def _refusal(entry, value) -> str:
    with pytest.raises(ConfigError) as caught:
        entry(value)
    return str(caught.value)


def test_context_exchange_runs_in_train_and_under_the_megatron_launcher():
    from megatron_slim.megatron.launch.flags import add_arguments

    parsed = add_arguments(argparse.ArgumentParser()).parse_args(["--slimpipe-slice-policy", "exchange"])
    assert parsed.slimpipe_slice_policy == "exchange"
    check_megatron_args(argparse.Namespace(**EXCHANGE))  # the launcher runs it
    check_megatron_args(argparse.Namespace(**EXCHANGE, virtual_pipeline_model_parallel_size=2))
    sets = ["parallel.pp=2", "schedule.num_slices=4", "schedule.slice_policy=exchange"]
    check_trainable(load_recipe("tiny-cpu", sets))  # megatron-slim train runs it
    check_trainable(load_recipe("tiny-cpu", [*sets, "parallel.vpp=2"]))  # interleaved too
    flags = recipe_to_megatron_args(load_recipe("tiny-cpu", sets))
    assert flags[flags.index("--slimpipe-slice-policy") + 1] == "exchange"


FULL_RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def test_the_megatron_launcher_runs_context_exchange_under_query_out_cp_and_full_recompute():
    check_megatron_args(argparse.Namespace(**{**EXCHANGE, "context_parallel_size": 2}))  # no --cp-engine
    check_megatron_args(
        argparse.Namespace(**{**EXCHANGE, "context_parallel_size": 2}, virtual_pipeline_model_parallel_size=2)
    )
    check_megatron_args(argparse.Namespace(**{**EXCHANGE, **FULL_RECOMPUTE}))
    block = {**FULL_RECOMPUTE, "recompute_method": "block", "recompute_num_layers": 2}
    check_megatron_args(argparse.Namespace(**{**EXCHANGE, **block}))
    # megatron-args spells cp.engine=ring under exchange as SlimPipe's query-out CP: no --cp-engine
    sets = ["parallel.pp=2", "parallel.cp=2", "schedule.num_slices=4", "schedule.slice_policy=exchange"]
    flags = recipe_to_megatron_args(load_recipe("tiny-cpu", [*sets, "cp.engine=ring"]))
    assert "--cp-engine" not in flags and flags[flags.index("--context-parallel-size") + 1] == "2"
    flags = recipe_to_megatron_args(load_recipe("tiny-cpu", ["parallel.pp=2", *sets[2:], "train.recompute=full"]))
    assert flags[flags.index("--recompute-granularity") + 1] == "full"


def test_the_megatron_launcher_runs_context_exchange_under_tensor_parallelism_and_selective_recompute():
    tp2 = {**EXCHANGE, "tensor_model_parallel_size": 2}
    check_megatron_args(argparse.Namespace(**tp2))  # each pair runs between the same TP rank of both stages
    check_megatron_args(argparse.Namespace(**{**tp2, "sequence_parallel": True}))
    check_megatron_args(argparse.Namespace(**tp2, virtual_pipeline_model_parallel_size=2))
    check_megatron_args(argparse.Namespace(**{**tp2, "context_parallel_size": 2}))
    selective = dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"])
    check_megatron_args(argparse.Namespace(**{**EXCHANGE, **selective}))  # a recomputed forward is not paired
    check_megatron_args(argparse.Namespace(**{**tp2, **selective}))
    sets = ["parallel.pp=2", "parallel.tp=2", "schedule.num_slices=4", "schedule.slice_policy=exchange"]
    flags = recipe_to_megatron_args(load_recipe("tiny-cpu", [*sets, "train.recompute=selective"]))
    assert flags[flags.index("--tensor-model-parallel-size") + 1] == "2"
    assert flags[flags.index("--recompute-granularity") + 1] == "selective"
    assert flags[flags.index("--slimpipe-slice-policy") + 1] == "exchange"


def test_the_megatron_launcher_refuses_context_exchange_with_the_vocabulary_exchange():
    flags = {**EXCHANGE, "slimpipe_vocab_parallel": True}
    assert broken_rule(settings_from_megatron_args(argparse.Namespace(**flags)), LAUNCHER).name == (
        "slice-policy-exchange"
    )
    assert _refusal(check_megatron_args, argparse.Namespace(**flags)) == (
        "--slimpipe-slice-policy exchange with --slimpipe-vocab-parallel: under Megatron-LM's launcher context "
        "exchange runs (with any vpp, tensor parallelism, SlimPipe's query-out context parallelism or activation "
        "recomputation) without the vocabulary exchange; allowed: drop --slimpipe-vocab-parallel, or "
        "--slimpipe-slice-policy uniform or balanced"
    )
    sets = ["parallel.pp=2", "schedule.num_slices=4", "schedule.slice_policy=exchange", "schedule.vocab_parallel=true"]
    refused = _refusal(recipe_to_megatron_args, load_recipe("tiny-cpu", sets))
    assert refused.endswith("allowed: schedule.vocab_parallel=false, or schedule.slice_policy=uniform or balanced")


@pytest.mark.parametrize("engine", ["ring", "zeppelin", "ulysses"])
def test_the_megatron_launcher_refuses_context_exchange_under_a_cp_engine(engine):
    flags = {**EXCHANGE, "context_parallel_size": 2, "cp_engine": engine}
    settings = settings_from_megatron_args(argparse.Namespace(**flags))
    assert broken_rule(settings, LAUNCHER).name == "slice-policy-exchange-cp-engine"
    assert _refusal(check_megatron_args, argparse.Namespace(**flags)) == (
        f"--slimpipe-slice-policy exchange with --context-parallel-size 2 and --cp-engine {engine}: context exchange "
        "runs under SlimPipe's query-out context parallelism over zigzag shards of plain causal windows (drop "
        "--cp-engine), not under an engine's planned windows; allowed: drop --cp-engine, "
        "--context-parallel-size 1, or --slimpipe-slice-policy uniform or balanced"
    )
    sets = ["parallel.pp=2", "parallel.cp=2", "schedule.num_slices=4", "schedule.slice_policy=exchange"]
    refused = _refusal(recipe_to_megatron_args, load_recipe("tiny-cpu", [*sets, "cp.engine=zeppelin"]))
    assert refused.endswith("allowed: cp.engine=ring, parallel.cp=1, or schedule.slice_policy=uniform or balanced")


def test_the_megatron_launcher_runs_context_exchange_with_recompute_under_query_out_cp():
    for recompute in (FULL_RECOMPUTE, {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}):
        flags = {**EXCHANGE, **recompute, "context_parallel_size": 2}
        assert broken_rule(settings_from_megatron_args(argparse.Namespace(**flags)), LAUNCHER) is None
    sets = ["parallel.pp=2", "parallel.cp=2", "schedule.num_slices=4", "schedule.slice_policy=exchange"]
    flags = recipe_to_megatron_args(load_recipe("tiny-cpu", [*sets, "cp.engine=ring", "train.recompute=full"]))
    assert "--cp-engine" not in flags and flags[flags.index("--recompute-granularity") + 1] == "full"


def test_the_megatron_launcher_refuses_context_exchange_on_packed_windows():
    refused = _refusal(
        check_megatron_args, argparse.Namespace(**EXCHANGE, slimpipe_packing="slimpack", calculate_per_token_loss=True)
    )
    assert refused == (
        "--slimpipe-slice-policy exchange: context exchange runs on unpacked windows only; allowed: "
        "--slimpipe-packing none, or --slimpipe-slice-policy uniform or balanced"
    )
