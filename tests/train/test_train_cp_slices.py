"""SlimPipe slices with a CP engine in ``megatron-slim train`` (``train/cp_slices.py``).

pp2 x cp2 (4 gloo ranks), SlimPipe over four windows cut into slices whose boundaries fall inside
documents: each window is planned once by the engine and every slice follows the plan (each CP
rank holds its planned rows of the slice; query-out attention reads the slice's K/V and the K/V
cached of the same documents' earlier slices). One step equals the single-process per-document
reference in the loss and in EVERY parameter gradient of both stages, for Zeppelin (documents kept
on one rank and documents spread over both), ring and Ulysses. The CLI then trains pp2 x cp2 with
slices and cp.engine=zeppelin to the losses of the pp1 x cp2 run without slices.
"""

import pytest

from megatron_slim.runtime.spawn import run_ranks
from tests.train.test_train_cp import EOD, _recipe, _train, _window
from tests.train.test_train_cp_pipeline import PIPELINE_WINDOWS, _check_against_reference, run_cp_step

SLICES = ((64, 64), (32, 48, 48))  # slice boundaries at 32, 64 and 80 cut documents of every window


def sliced_pipeline_step(rank, world_size, cases, hardware_path, window_lengths, seed=1234):
    """Per case ``(engine, slice lengths)``: one SlimPipe forward-backward on pp2 x cp2 through the
    training job's sliced CP plumbing, gradients finished as the loop does."""
    from megatron_slim.megatron.model.gpt import build_rank_chunks
    from megatron_slim.megatron.model.parallel import init_model_parallel
    from megatron_slim.megatron.slimpipe.schedule import SlimPipeSettings, make_forward_backward_func
    from megatron_slim.megatron.slimpipe.slicing import SliceCoreAttention
    from megatron_slim.train.cp_slices import CPSlicedTrainStep
    from megatron_slim.train.step import sum_tied_embedding_grads
    from tests.oracle import reference
    from tests.train.test_train_cp import _reference

    groups = init_model_parallel(pp=2, cp=2)
    solo = reference.solo_groups(rank, world_size)
    windows = [_window(lengths, seed + k) for k, lengths in enumerate(window_lengths)]
    results = {"pp_rank": groups.pp_rank, "cp_rank": groups.cp_rank}
    for engine, lengths in cases:
        recipe = _recipe(engine, False, 2, hardware_path, len(windows))
        chunks = build_rank_chunks(recipe.model, groups, core_attention=SliceCoreAttention, seed=seed)
        step = CPSlicedTrainStep(recipe, groups, EOD, lengths)
        settings = SlimPipeSettings(lengths, kind="slimpipe", measure_memory=True)
        fb = make_forward_backward_func(settings, context=step.slices, stage_rows=step.stage_rows)
        tied = lambda: sum_tied_embedding_grads(chunks, groups.embd)  # noqa: E731
        results[engine, lengths] = run_cp_step(fb, step.forward_step, step, chunks, groups, windows, tied)
        uneven = [any(s.tokens(0) != s.tokens(1) for s in shares) for shares in step.shares]
        results[engine, lengths].update(summary=step.summary(), uneven=uneven)
    if rank == 0:
        results["reference"] = _reference(recipe.model, solo, windows, seed)
    return results


@pytest.mark.multi
def test_pp2_cp2_slimpipe_slices_follow_the_plan_and_match_the_per_document_reference(hardware):
    cases = [("zeppelin", SLICES[0]), ("zeppelin", SLICES[1]), ("ring", SLICES[1]), ("ulysses", SLICES[0])]
    results = run_ranks(sliced_pipeline_step, 4, cases, hardware, PIPELINE_WINDOWS, timeout_s=600)
    zeppelin = results[0]["zeppelin", SLICES[0]]
    assert zeppelin["summary"]["local"] > 0 and zeppelin["summary"]["inter"] > 0
    assert any(zeppelin["uneven"])  # slices whose rows differ between the CP ranks crossed the stage boundary
    _check_against_reference(results, cases)


@pytest.mark.multi
def test_cli_trains_pp2_cp2_slimpipe_slices_with_zeppelin_and_matches_pp1(
    tmp_path, data_cache, short_documents, hardware
):
    """The reference run is pp1 x cp2 without slices (1F1B, the same engine): cp=1 attends across the
    whole window, while every CP engine keeps attention inside each document."""
    sets = ["parallel.cp=2", "cp.engine=zeppelin", f"hardware={hardware}"]
    sliced = ["parallel.pp=2", "schedule.kind=slimpipe", "schedule.num_slices=4"]
    piped = _train(tmp_path, "pp2-slices", data_cache, short_documents, *sets, *sliced)
    flat = _train(tmp_path, "pp1", data_cache, short_documents, *sets)
    assert len(piped["losses"]) == 4 and piped["losses"][-1] < piped["losses"][0]
    assert piped["losses"] == pytest.approx(flat["losses"], abs=2e-4)
    assert piped["cp"]["engine"] == "zeppelin" and sum(i["local"] for i in piped["cp"]["iterations"]) > 0
