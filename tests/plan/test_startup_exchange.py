"""Context exchange at start-up: ``megatron-slim train`` and the Megatron-LM launcher run
``exchange`` (uniform slices plus context exchange), each refusing by name what it does not run it
with; ``megatron-args`` emits the flag for the launcher (train's own rules: ``test_startup_rules_exchange.py``)."""

import argparse

import pytest

from megatron_slim.megatron.launch.flags import check_megatron_args, recipe_to_megatron_args
from megatron_slim.plan.recipe import load_recipe
from megatron_slim.plan.schema import ConfigError
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


@pytest.mark.parametrize(
    "bad, named",
    [
        (dict(tensor_model_parallel_size=2), "--tensor-model-parallel-size 2"),
        (dict(context_parallel_size=2), "--context-parallel-size 2"),
        (dict(recompute_granularity="selective"), "--recompute-granularity selective"),
        (dict(slimpipe_vocab_parallel=True), "--slimpipe-vocab-parallel"),
    ],
)
def test_the_megatron_launcher_refuses_context_exchange_where_it_does_not_run(bad, named):
    refused = _refusal(check_megatron_args, argparse.Namespace(**{**EXCHANGE, **bad}))
    assert refused.startswith("--slimpipe-slice-policy exchange with --tensor-model-parallel-size ")
    assert named in refused and refused.endswith(
        "allowed: --tensor-model-parallel-size 1, --context-parallel-size 1, drop --recompute-granularity and "
        "drop --slimpipe-vocab-parallel, or --slimpipe-slice-policy uniform or balanced"
    )


def test_the_megatron_launcher_refuses_context_exchange_on_packed_windows():
    refused = _refusal(
        check_megatron_args, argparse.Namespace(**EXCHANGE, slimpipe_packing="slimpack", calculate_per_token_loss=True)
    )
    assert refused == (
        "--slimpipe-slice-policy exchange: context exchange runs on unpacked windows only; allowed: "
        "--slimpipe-packing none, or --slimpipe-slice-policy uniform or balanced"
    )
