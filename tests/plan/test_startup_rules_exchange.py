"""Start-up rules of context exchange (``schedule.slice_policy: exchange``): ``megatron-slim train``
runs it (any vpp, any tp; under ``parallel.cp > 1`` as zigzag query-out, named by ``cp.engine=ring``) and
refuses the rest by name (the launcher's rules: ``test_startup_exchange.py``)."""

import pytest

from megatron_slim.plan.recipe import load_recipe
from megatron_slim.plan.startup import TRAIN, broken_rule
from megatron_slim.plan.startup.from_recipe import train_settings
from megatron_slim.train.checks import check_trainable
from tests.plan.test_startup_rules import _refusal


def test_context_exchange_runs_in_train_with_any_vpp_and_under_cp():
    sets = ["parallel.pp=2", "schedule.num_slices=4", "schedule.slice_policy=exchange"]
    check_trainable(load_recipe("tiny-cpu", sets))  # megatron-slim train runs it
    check_trainable(load_recipe("tiny-cpu", [*sets, "parallel.vpp=2"]))  # interleaved too
    under_cp = load_recipe("tiny-cpu", [*sets, "parallel.cp=2"])  # query-out CP, named by cp.engine=ring
    assert under_cp.cp.engine == "ring" and under_cp.exchange_cp and under_cp.query_out_cp
    check_trainable(under_cp)
    check_trainable(load_recipe("tiny-cpu", [*sets, "parallel.cp=2", "parallel.vpp=2"]))
    settings = train_settings(under_cp)
    assert (settings.cp_engine, settings.cp_engine_runs) == ("ring", False)  # no engine plans windows


def test_train_runs_context_exchange_under_tensor_parallelism():
    sets = ["parallel.pp=2", "schedule.num_slices=4", "schedule.slice_policy=exchange", "parallel.tp=2"]
    check_trainable(load_recipe("tiny-cpu", sets))  # each pair runs between the same TP rank of both stages
    check_trainable(load_recipe("tiny-cpu", [*sets, "parallel.cp=2"]))
    check_trainable(load_recipe("tiny-cpu", [*sets, "parallel.vpp=2"]))
    assert broken_rule(train_settings(load_recipe("tiny-cpu", sets)), TRAIN) is None


def test_train_refuses_context_exchange_with_the_vocabulary_exchange():
    sets = ["parallel.pp=2", "schedule.num_slices=4", "schedule.slice_policy=exchange", "schedule.vocab_parallel=true"]
    assert _refusal(check_trainable, load_recipe("tiny-cpu", sets)) == (
        "schedule.slice_policy=exchange with schedule.vocab_parallel=true: context exchange runs (with any vpp, "
        "tensor or context parallelism or activation recomputation) without the vocabulary exchange; allowed: "
        "schedule.vocab_parallel=false, or schedule.slice_policy=uniform or balanced"
    )
    assert broken_rule(train_settings(load_recipe("tiny-cpu", sets)), TRAIN).name == "slice-policy-exchange-train"


@pytest.mark.parametrize("recompute", [["train.recompute=full"], ["train.recompute=selective"]])
def test_train_runs_context_exchange_with_recomputation_at_cp1_and_cp2(recompute):
    sets = ["parallel.pp=2", "schedule.num_slices=4", "schedule.slice_policy=exchange", *recompute]
    check_trainable(load_recipe("tiny-cpu", sets))
    recipe = load_recipe("tiny-cpu", [*sets, "parallel.cp=2"])
    assert recipe.exchange_cp
    check_trainable(recipe)  # SlimPipe's query-out CP (cp.engine=ring names it)


@pytest.mark.parametrize("engine", ["zeppelin", "ulysses"])
def test_train_refuses_context_exchange_under_a_cp_engine_other_than_ring(engine):
    sets = ["parallel.pp=2", "parallel.cp=2", "schedule.num_slices=4", "schedule.slice_policy=exchange"]
    recipe = load_recipe("tiny-cpu", [*sets, f"cp.engine={engine}"])
    assert broken_rule(train_settings(recipe), TRAIN).name == "slice-policy-exchange-cp"
    assert _refusal(check_trainable, recipe) == (
        f"schedule.slice_policy=exchange with parallel.cp=2 and cp.engine={engine}: context exchange runs under "
        "SlimPipe's query-out context parallelism over zigzag shards of plain causal windows, which "
        "cp.engine=ring names, not under an engine's planned windows; allowed: cp.engine=ring, or "
        "parallel.cp=1, or schedule.slice_policy=uniform or balanced"
    )
