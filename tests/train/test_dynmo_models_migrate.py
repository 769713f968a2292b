"""The dynamic models across a live migration (gloo ranks, pp=2): pruned neurons and MoE layers
move between the ranks mid-run and the run keeps the losses of the run that never moved."""

import pytest

from megatron_slim.runtime.spawn import run_ranks
from megatron_slim.train.loop import train_rank
from megatron_slim.train.report import TrainOptions
from tests.train.test_train_migrate import _assert_moves_kept_state, _losses, _migrating_run, _prepared, _recipe

pytestmark = [pytest.mark.multi, pytest.mark.slow]  # default tier: test_train_migrate.py moves layers


@pytest.mark.parametrize(
    "sets, key",
    [
        (['dynmo.prune="1-3:0.5"'], "kept_neuron_share"),  # the mask is re-derived from the moved weights
        (["dynmo.moe_experts=4", "dynmo.moe_drift=1"], "expert_load"),
    ],
    ids=["prune", "moe"],
)
def test_dynamic_models_keep_their_losses_across_a_move(data_cache, sets, key):
    recipe = _recipe(data_cache, "parallel.pp=2", *sets)
    static = run_ranks(train_rank, 2, recipe.to_dict(), _prepared(recipe), TrainOptions(quiet=True))
    migrations = [(2, (2, 6)), (3, (6, 2))]
    reports, records = _migrating_run(data_cache, 2, migrations, sets=sets)
    _assert_moves_kept_state(records, migrations, 2)
    assert _losses(reports) == pytest.approx(_losses(static), rel=1e-6, abs=0)
    assert all(r.dynmo[key] for r in reports)
    if key == "kept_neuron_share":  # iteration 4 ran after both moves: each rank's layers, half kept
        assert sorted(layer for r in reports for layer in r.dynmo[key]) == list(range(8))
        assert all(share == 0.5 for r in reports for share in r.dynmo[key].values())
