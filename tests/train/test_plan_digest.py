"""The schedule a ``megatron-slim train`` rank runs is the one ``megatron-slim simulate`` times:
the runtime's planning calls (``train.loop.pipeline_settings``, ``megatron.slimpipe.call_plan.planned_schedule``)
give the simulator's schedule digest for the same recipe, without spawning ranks."""

import pytest

from megatron_slim.commands.simulate import run_one
from megatron_slim.megatron.slimpipe.call_plan import planned_schedule
from megatron_slim.plan.recipe import load_recipe
from megatron_slim.plan.variants import schedule_variant
from megatron_slim.train.loop import pipeline_settings

EXCHANGE = "schedule.slice_policy=exchange"
CASES = [
    ("tiny-cpu", [], None),
    ("tiny-cpu", [], "1f1b"),
    ("tiny-cpu", [], "interleaved"),
    ("tiny-cpu", ["parallel.pp=2", "train.global_batch_size=4", "model.seq_length=128", "schedule.num_slices=2"], None),
    ("tiny-cpu", ["parallel.pp=2", "parallel.vpp=2", "schedule.num_slices=3", "schedule.slice_policy=balanced"], None),
    ("tiny-cpu", ["schedule.slice_policy=uniform"], None),
    ("tiny-cpu", ["parallel.pp=4", "schedule.slice_policy=exchange"], None),
    ("tiny-cpu", ["parallel.pp=2", "schedule.slice_policy=exchange"], None),
    ("tiny-cpu", ["parallel.pp=2", "parallel.vpp=2", "schedule.slice_policy=exchange"], None),
    ("tiny-cpu", ["parallel.pp=2", "parallel.cp=2", "schedule.slice_policy=exchange"], None),
    ("tiny-cpu", ["parallel.pp=4", "parallel.cp=2", "schedule.slice_policy=exchange"], None),
    ("llama2-7b-64k", ["parallel.dp=1", "train.global_batch_size=4", "schedule.num_slices=8", EXCHANGE], None),
    ("llama2-7b-64k", [], None),
    ("llama3-8b-256k", [], None),
    ("zeppelin-7b-h800", [], None),
]


@pytest.mark.parametrize("name,sets,kind", CASES)
def test_runtime_plan_digest_equals_the_simulators(name, sets, kind):
    recipe = load_recipe(name, sets)
    if kind is not None:
        recipe = schedule_variant(recipe, kind)
    settings = pipeline_settings(recipe)
    p = recipe.parallel
    runtime = planned_schedule(settings, p.pp, p.vpp, recipe.num_microbatches)
    simulated = run_one(recipe)
    assert settings.slice_lengths == tuple(simulated.costs.lengths)
    assert runtime.digest() == simulated.result.schedule.digest()
    assert runtime == simulated.result.schedule
    if recipe.schedule.slice_policy == "exchange":  # the pairing train runs is the one simulate prices
        assert runtime.exchange == simulated.result.schedule.exchange


def test_the_runtime_plans_each_shape_once():
    """Every iteration asks ``planned_schedule`` again; the lowered, validated schedule is reused."""
    settings = pipeline_settings(load_recipe("tiny-cpu", ["parallel.pp=2", "schedule.num_slices=2"]))
    first = planned_schedule(settings, 2, 1, 4)
    assert planned_schedule(settings, 2, 1, 4) is first
    assert planned_schedule(settings, 2, 1, 2) is not first


def test_the_runtime_times_each_exchange_shape_once():
    settings = pipeline_settings(load_recipe("tiny-cpu", ["parallel.pp=4", "schedule.slice_policy=exchange"]))
    first = planned_schedule(settings, 4, 1, 8)
    assert first.exchange and planned_schedule(settings, 4, 1, 8) is first


def test_an_exchange_call_on_another_pipeline_than_the_recipes_is_refused():
    settings = pipeline_settings(load_recipe("tiny-cpu", ["parallel.pp=4", "schedule.slice_policy=exchange"]))
    with pytest.raises(ValueError, match="parallel.pp=4.*pp=2"):
        planned_schedule(settings, 2, 1, 8)
