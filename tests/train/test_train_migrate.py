"""DynMo live migration in `megatron-slim train` (gloo ranks): an uneven split trains like one
process, layers moved between pipeline ranks mid-run keep every weight, gradient and AdamW state
bit for bit and the losses of a run that never moved, and checkpoints load across changed splits."""

import pytest

from megatron_slim.plan.recipe import load_recipe
from megatron_slim.runtime.spawn import run_ranks
from megatron_slim.train.loop import train_rank
from megatron_slim.train.report import TrainOptions
from tests.train._migration_workers import train_migrating
from tests.train.conftest import SMALL_DATA
from tests.train.test_train_job import _train

pytestmark = pytest.mark.multi

SETS = ["train.global_batch_size=4", "model.seq_length=128", "train.warmup_iters=1", "train.iters=4"]


def _recipe(data_cache, *sets):
    return load_recipe("tiny-cpu", [f"data.cache_dir={data_cache}", *SMALL_DATA, *SETS, *sets])


def _prepared(recipe):
    from megatron_slim.commands.train import _prepare

    return _prepare(recipe, say=False)


def _losses(reports):
    return [loss for _, loss in next(r for r in reports if r.losses).losses]


@pytest.fixture(scope="module")
def pp2_even(tmp_path_factory, data_cache):
    return _train(tmp_path_factory.mktemp("even"), "pp2", data_cache, *SETS, "parallel.pp=2")


# slow: uneven splits train in the default tier in test_layers_moved_mid_run_keep_their_state_and_the_losses
# ((6, 2), (1, 7) against the even run), and pipelining matches one process in
# tests/runtime/pipeline/test_slimpipe_exactness.py
@pytest.mark.slow
def test_an_uneven_split_trains_like_one_process(tmp_path, data_cache, pp2_even):
    single = _train(tmp_path, "pp1", data_cache, *SETS, "parallel.pp=1")
    uneven = _train(tmp_path, "uneven", data_cache, *SETS, "parallel.pp=2", "parallel.layers_per_stage=[6,2]")
    assert uneven["losses"] == pytest.approx(single["losses"], rel=1e-6, abs=0)
    assert pp2_even["losses"] == pytest.approx(single["losses"], rel=1e-6, abs=0)
    assert single["losses"][-1] < single["losses"][0]


def _migrating_run(data_cache, pp: int, migrations, dp: int = 1, sets=()):
    recipe = _recipe(data_cache, f"parallel.pp={pp}", f"parallel.dp={dp}", *sets)
    options = TrainOptions(quiet=True, migrations=tuple(migrations))
    results = run_ranks(train_migrating, pp * dp, recipe.to_dict(), _prepared(recipe), options)
    return [r for r, _ in results], [records for _, records in results]


def _assert_moves_kept_state(records, migrations, pp: int, pp_ranks=None):
    """Every rank refused the bad partition and recorded each move it took part in; ranks that stay
    hold the new split's layers with every checksum as before; released ranks record no more moves."""
    for rank, rank_records in zip(pp_ranks or range(len(records)), records):
        stages = pp  # the run's stage count when each migration was asked for
        for record, (_, split) in zip(rank_records, migrations):
            assert (
                "migration refused, nothing moved" in record["refused"]
                and f"allowed: {stages} stages" in record["refused"]
            )
            stages = len(split)
            if rank >= len(split):
                assert record["moved"].released and rank_records[-1] is record
                break
            assert record["same"] and record["names"] > 0 and not record["moved"].released
            start = sum(split[:rank])
            assert record["layers"] == [list(range(start, start + split[rank]))]
        else:
            assert len(rank_records) == len(migrations)


def test_layers_moved_mid_run_keep_their_state_and_the_losses(data_cache, pp2_even):
    migrations = [(1, (6, 2)), (2, (1, 7)), (3, (4, 4))]
    reports, records = _migrating_run(data_cache, 2, migrations)
    _assert_moves_kept_state(records, migrations, 2)
    assert records[0][1]["moved"].layers_sent == 5 and records[1][1]["moved"].layers_received == 5
    assert _losses(reports) == pytest.approx(pp2_even["losses"], rel=1e-6, abs=0)


@pytest.mark.slow  # default-tier time: the same path runs in a cheaper case of this file
def test_frozen_layers_stay_frozen_across_a_move(data_cache):
    """The dynmo section's hooks are rebuilt on the new chunks: layers 0..3 freeze from iteration 2,
    then move between the ranks, and the run keeps the losses of the run that never moved."""
    freeze = ['dynmo.freeze="2:0-3"']
    recipe = _recipe(data_cache, "parallel.pp=2", *freeze)
    static = run_ranks(train_rank, 2, recipe.to_dict(), _prepared(recipe), TrainOptions(quiet=True))
    migrations = [(2, (2, 6)), (3, (6, 2))]
    reports, records = _migrating_run(data_cache, 2, migrations, sets=freeze)
    _assert_moves_kept_state(records, migrations, 2)
    assert all(r.dynmo["frozen_layers"] == [0, 1, 2, 3] for r in reports)
    assert _losses(reports) == pytest.approx(_losses(static), rel=1e-6, abs=0)


@pytest.mark.slow
def test_pp4_moves_across_several_stages(data_cache):
    recipe = _recipe(data_cache, "parallel.pp=4")
    static = run_ranks(train_rank, 4, recipe.to_dict(), _prepared(recipe), TrainOptions(quiet=True))
    migrations = [(1, (5, 1, 1, 1)), (2, (1, 1, 1, 5)), (3, (2, 3, 2, 1))]
    reports, records = _migrating_run(data_cache, 4, migrations)
    _assert_moves_kept_state(records, migrations, 4)
    assert _losses(reports) == pytest.approx(_losses(static), rel=1e-6, abs=0)


@pytest.mark.slow
def test_each_data_parallel_replica_moves_its_own_layers(data_cache):
    recipe = _recipe(data_cache, "parallel.pp=2", "parallel.dp=2")
    static = run_ranks(train_rank, 4, recipe.to_dict(), _prepared(recipe), TrainOptions(quiet=True))
    migrations = [(1, (6, 2)), (2, (3, 5))]
    reports, records = _migrating_run(data_cache, 2, migrations, dp=2)
    assert sorted(r.pp_rank for r in reports) == [0, 0, 1, 1]
    _assert_moves_kept_state(records, migrations, 2, pp_ranks=[r.pp_rank for r in reports])
    assert _losses(reports) == pytest.approx(_losses(static), rel=1e-6, abs=0)


# slow tier: tests/train/test_train_reshard.py resumes a checkpoint at another split (pp4 to pp2) in
# the default tier, and test_layers_moved_mid_run_keep_their_state_and_the_losses trains on at the
# uneven split a move leaves
@pytest.mark.slow
def test_a_checkpoint_resumes_at_another_uneven_split(tmp_path, data_cache, pp2_even):
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt")]
    first = _train(
        tmp_path,
        "a",
        data_cache,
        *SETS,
        "parallel.pp=2",
        "parallel.layers_per_stage=[2,6]",
        extra=[*ckpt, "--exit-interval", "2"],
    )
    assert first["last_iteration"] == 2
    resumed = _train(tmp_path, "b", data_cache, *SETS, "parallel.pp=2", "parallel.layers_per_stage=[7,1]", extra=ckpt)
    assert resumed["resumed_from"] == 2
    assert resumed["losses"] == pytest.approx(pp2_even["losses"], rel=1e-6, abs=0)


def test_consolidation_onto_one_rank_keeps_the_state_and_the_losses(data_cache, pp2_even):
    reports, records = _migrating_run(data_cache, 2, [(2, (8,))])
    _assert_moves_kept_state(records, [(2, (8,))], 2)
    assert records[1][0]["moved"].released and records[1][0]["moved"].layers_sent == 4
    assert records[0][0]["moved"].layers_received == 4 and reports[1].losses == []
    assert reports[0].last_iteration == 4 and reports[1].last_iteration == 2
    assert _losses(reports) == pytest.approx(pp2_even["losses"], rel=1e-6, abs=0)


@pytest.mark.slow
def test_pp4_consolidates_onto_two_ranks_then_rebalances(data_cache):
    recipe = _recipe(data_cache, "parallel.pp=4")
    static = run_ranks(train_rank, 4, recipe.to_dict(), _prepared(recipe), TrainOptions(quiet=True))
    migrations = [(1, (5, 3)), (2, (2, 6))]
    reports, records = _migrating_run(data_cache, 4, migrations)
    _assert_moves_kept_state(records, migrations, 4)
    assert [len(r) for r in records] == [2, 2, 1, 1]
    assert _losses(reports) == pytest.approx(_losses(static), rel=1e-6, abs=0)
