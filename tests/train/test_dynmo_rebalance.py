"""The automatic rebalancing trigger in `megatron-slim train` (gloo ranks): with the first layers
frozen, the measured profile makes the first stages cheap, the trigger moves layers toward them,
and the run keeps the losses of the same run with rebalance static (migration keeps state)."""

import pytest

from megatron_slim.plan.recipe import load_recipe
from megatron_slim.runtime.spawn import run_ranks
from megatron_slim.train.loop import train_rank
from megatron_slim.train.report import TrainOptions
from tests.train.conftest import SMALL_DATA

pytestmark = pytest.mark.multi

SETS = ["train.global_batch_size=4", "model.seq_length=128", "train.warmup_iters=1", "train.iters=4"]
FROZEN = ["dynmo.profile=true", 'dynmo.freeze="1:0-3"']  # tiny-cpu: layers 0..7


def _run(data_cache, pp: int, *sets):
    from megatron_slim.commands.train import _prepare

    recipe = load_recipe("tiny-cpu", [f"data.cache_dir={data_cache}", *SMALL_DATA, *SETS, f"parallel.pp={pp}", *sets])
    return run_ranks(train_rank, pp, recipe.to_dict(), _prepare(recipe, say=False), TrainOptions(quiet=True))


def _losses(reports):
    return [loss for _, loss in next(r for r in reports if r.losses).losses]


def _check(data_cache, pp: int, first_stages: int):
    static = _run(data_cache, pp, *FROZEN)
    moved = _run(data_cache, pp, *FROZEN, "dynmo.rebalance=dynmo", "dynmo.rebalance_interval=2")
    decisions = [r.dynmo["rebalance"] for r in moved]
    assert all(d == decisions[0] for d in decisions), "every rank takes the same decisions"
    first = decisions[0][0]
    assert first["iteration"] == 2 and first["move"] and first["before"] == [8 // pp] * pp
    split = first["proposed"]  # layers leave the last stage (output layer, nothing frozen) ...
    assert split[-1] < 8 // pp and all(n >= 8 // pp for n in split[:first_stages])  # ... frozen ones keep theirs
    assert first["step_after_s"] < first["step_before_s"]
    assert "rebalance" not in static[0].dynmo
    assert _losses(moved) == pytest.approx(_losses(static), rel=1e-6, abs=0)


# slow tier: the trigger's decision is tested in tests/plan (plan/dynmo/trigger.py, pure) and a move's
# losses and state in tests/train/test_train_migrate.py
@pytest.mark.slow
def test_the_trigger_moves_layers_to_the_frozen_stage_and_keeps_the_losses(data_cache):
    _check(data_cache, 2, 1)


@pytest.mark.slow
def test_pp4_trigger_moves_layers_to_the_frozen_stages_and_keeps_the_losses(data_cache):
    _check(data_cache, 4, 2)


def test_a_frozen_prefix_with_its_embedding_runs_no_backward_and_trains_like_one_process(data_cache):
    """Layers 0..4 and the embedding frozen: stage 0 (layers 0..3) builds no autograd graph, stage 1
    runs layer 4 on a detached input and sends zeros back; the losses are those of one process."""
    frozen = ["dynmo.profile=true", 'dynmo.freeze="1:0-4"', "dynmo.freeze_embedding=true"]
    single = _run(data_cache, 1, *frozen)
    piped = _run(data_cache, 2, *frozen)
    assert _losses(piped) == pytest.approx(_losses(single), rel=1e-6, abs=0)
    profile = next(r for r in piped if r.pp_rank == 1).dynmo["layer_profile"]
    assert [p["backward_s"] for p in profile[:5]] == [0.0] * 5  # no backward ran for them
    assert all(p["backward_s"] > 0 for p in profile[6:])
