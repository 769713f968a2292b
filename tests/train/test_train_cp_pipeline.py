"""CP engines under pipeline parallelism in ``megatron-slim train`` (``parallel.pp > 1``, ``cp.engine``).

pp2 x cp2 (4 ranks), 1F1B over four microbatch windows: every stage plans every window itself
(``train.cp.CPTrainStep``), the stages agree on the iteration's plans, and the hidden states between
stages hold this CP rank's per-microbatch token count in the plan's attention layout
(``stage_rows``). One step equals the single-process per-document reference in the loss and in
EVERY parameter gradient of both stages (fp32; RoPE, RMSNorm, SwiGLU and GQA on), for Zeppelin
(with remap, so the remapped layout must be undone before a stage boundary), ring and Ulysses,
and for the engines that leave a CP rank without tokens (its one padding row crosses the
boundary too). Stages that planned different windows stop on every rank, naming the digests. The
CLI then trains pp2 x cp2 (1F1B) and pp2 x vpp2 x cp2 (interleaved) to the losses of pp1.
"""

import pytest
import torch
import torch.distributed as dist

from megatron_slim.runtime.spawn import run_ranks
from tests.train.test_train_cp import EOD, MODEL, TOL, WINDOWS, _recipe, _reference, _train, _window

# four windows so 1F1B runs a forward of one microbatch between the backwards of others
PIPELINE_WINDOWS = tuple(WINDOWS) + ((30, 30, 68), (128,))
ONE_TOKEN_WINDOWS = ((1,) * MODEL["seq_length"], (64, 64))


def run_cp_step(fb, forward_step, step, chunks, groups, windows, finish_shared) -> dict:
    """One forward-backward of ``windows`` through ``fb`` with a CP step's plans, gradients finished as
    the loop does (``finish_shared()``: the tied or vocab-parallel weights, then the data x CP average);
    returns this rank's gradients by global name and the (loss sum, token count) pair over the CP group."""
    from megatron_slim.megatron.model.gpt import global_grads
    from megatron_slim.train.step import average_data_parallel

    reports = fb(
        forward_step_func=forward_step,
        data_iterator=[iter(step.plan_iteration(windows))],
        model=chunks,
        num_microbatches=len(windows),
        seq_length=MODEL["seq_length"],
        micro_batch_size=1,
    )
    finish_shared()
    average_data_parallel([p for c in chunks for p in c.parameters()], groups.dp_cp, 2)
    grads = {}
    for c in chunks:
        grads.update(global_grads(c))
    pair = torch.stack([r["lm loss"] for r in reports]).sum(0) if reports else torch.zeros(2)
    if groups.pp_rank == 1:
        dist.all_reduce(pair, group=groups.cp)
    return {"grads": grads, "pair": pair}


def pipeline_step(rank, world_size, cases, hardware_path, window_lengths, seed=1234):
    """Per case ``(engine, remap)``: one 1F1B forward-backward of the training job's CP plumbing on
    pp2 x cp2, gradients finished as the loop does; returns this rank's gradients by global name."""
    from megatron_slim.megatron.model.gpt import build_rank_chunks
    from megatron_slim.megatron.model.parallel import init_model_parallel
    from megatron_slim.megatron.slimpipe.schedule import SlimPipeSettings, make_forward_backward_func
    from megatron_slim.train.cp import CPTrainStep, cp_layer_classes
    from megatron_slim.train.step import sum_tied_embedding_grads
    from tests.oracle import reference

    groups = init_model_parallel(pp=2, cp=2)
    solo = reference.solo_groups(rank, world_size)
    windows = [_window(lengths, seed + k) for k, lengths in enumerate(window_lengths)]
    results = {"pp_rank": groups.pp_rank, "cp_rank": groups.cp_rank}
    for engine, remap in cases:
        recipe = _recipe(engine, remap, 2, hardware_path, len(windows))
        chunks = build_rank_chunks(recipe.model, groups, **cp_layer_classes(recipe), seed=seed)
        step = CPTrainStep(recipe, groups, EOD)
        step.attach(chunks)
        settings = SlimPipeSettings((MODEL["seq_length"],), kind="1f1b", measure_memory=True)
        fb = make_forward_backward_func(settings, stage_rows=step.stage_rows)
        tied = lambda: sum_tied_embedding_grads(chunks, groups.embd)  # noqa: E731
        results[engine, remap] = run_cp_step(fb, step.forward_step, step, chunks, groups, windows, tied)
        results[engine, remap]["summary"] = step.summary()
    if rank == 0:
        results["reference"] = _reference(recipe.model, solo, windows, seed)
    return results


def _check_against_reference(results, cases):
    ref_loss, ref_grads = results[0]["reference"]
    for case in cases:
        got = {}
        for r in results:
            if r["cp_rank"] == 0:
                got.update(r[case]["grads"])
        assert got.keys() == ref_grads.keys(), case
        for name, want in ref_grads.items():
            where = f"{case} {name}"
            torch.testing.assert_close(got[name], want, **TOL, msg=lambda m, where=where: f"{where}: {m}")
        last = [r for r in results if r["pp_rank"] == 1]
        assert len(last) == 2
        for r in last:  # the summed [loss, tokens] reports give the token-weighted mean loss
            torch.testing.assert_close(r[case]["pair"][0] / r[case]["pair"][1], ref_loss, **TOL)


@pytest.mark.multi
def test_pp2_cp2_1f1b_step_matches_the_per_document_reference(hardware):
    cases = [("zeppelin", True), ("ring", False), ("ulysses", False)]
    results = run_ranks(pipeline_step, 4, cases, hardware, PIPELINE_WINDOWS, timeout_s=600)
    zeppelin = results[0]["zeppelin", True]["summary"]
    assert zeppelin["local"] > 0 and zeppelin["inter"] > 0 and zeppelin["remapped_tokens"] > 0
    # the plans give the two CP ranks different token counts, so the stage boundary carried uneven rows
    assert zeppelin["min_tokens_per_rank"] != zeppelin["max_tokens_per_rank"]
    _check_against_reference(results, cases)


@pytest.mark.multi
def test_pp2_cp2_with_an_empty_cp_rank_matches_the_reference_under_every_other_engine(hardware):
    cases = [("allgather", False), ("a2a+p2p", False), ("dynamic", False)]
    results = run_ranks(pipeline_step, 4, cases, hardware, ONE_TOKEN_WINDOWS, timeout_s=600)
    assert results[0]["allgather", False]["summary"]["padded"] == 1
    _check_against_reference(results, cases)


def plan_on_each_stage(rank, world_size, hardware_path, stage_windows):
    """Plan ``stage_windows[pp_rank]`` on each stage; returns the error text of the agreement (or "")."""
    from megatron_slim.megatron.model.parallel import init_model_parallel
    from megatron_slim.train.cp import CPTrainStep

    groups = init_model_parallel(pp=2, cp=2)
    windows = [_window(lengths, 7 + k) for k, lengths in enumerate(stage_windows[groups.pp_rank])]
    step = CPTrainStep(_recipe("zeppelin", True, 2, hardware_path, len(windows)), groups, EOD)
    try:
        step.plan_iteration(windows)
    except RuntimeError as error:
        return str(error)
    return ""


@pytest.mark.multi
@pytest.mark.slow  # default-tier time: the same path runs in a cheaper case of this file
def test_pipeline_stages_that_plan_different_windows_stop_on_every_rank(hardware):
    same = run_ranks(plan_on_each_stage, 4, hardware, (WINDOWS, WINDOWS), timeout_s=300)
    assert same == [""] * 4
    other = [tuple(reversed(w)) for w in WINDOWS]  # same tokens per window, other documents
    errors = run_ranks(plan_on_each_stage, 4, hardware, (WINDOWS, other), timeout_s=300)
    for error in errors:
        assert error.startswith("pipeline ranks disagree on the iteration's CP plans (pipeline rank 0: "), error
        assert error.endswith("every pipeline stage must plan the same windows with the same recipe")


@pytest.mark.multi
@pytest.mark.slow  # default-tier time: test_pp2_cp2_1f1b_step_matches_the_per_document_reference runs this path
def test_cli_trains_pp2_cp2_with_zeppelin_and_matches_pp1(tmp_path, data_cache, short_documents, hardware):
    corpus = short_documents
    sets = ["parallel.cp=2", "cp.engine=zeppelin", "cp.remap=true", f"hardware={hardware}"]
    piped = _train(tmp_path, "pp2", data_cache, corpus, *sets, "parallel.pp=2")
    flat = _train(tmp_path, "pp1", data_cache, corpus, *sets)
    assert len(piped["losses"]) == 4 and piped["losses"][-1] < piped["losses"][0]
    assert piped["losses"] == pytest.approx(flat["losses"], abs=2e-4)
    assert piped["cp"]["engine"] == "zeppelin" and all(i["packs"] == 4 for i in piped["cp"]["iterations"])
    assert sum(i["inter"] for i in piped["cp"]["iterations"]) > 0


@pytest.mark.multi
@pytest.mark.slow  # default-tier time: the same path runs in a cheaper case of this file
def test_cli_trains_interleaved_pp2_vpp2_cp2_with_ring_and_matches_pp1(tmp_path, data_cache, short_documents, hardware):
    sets = ["parallel.cp=2", "cp.engine=ring", f"hardware={hardware}", "model.num_layers=4"]
    interleaved = _train(
        tmp_path,
        "vpp2",
        data_cache,
        short_documents,
        *sets,
        "parallel.pp=2",
        "parallel.vpp=2",
        "schedule.kind=interleaved",
    )
    flat = _train(tmp_path, "pp1", data_cache, short_documents, *sets)
    assert interleaved["losses"] == pytest.approx(flat["losses"], abs=2e-4)
