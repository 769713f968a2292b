"""``schedule.vocab_parallel`` under context parallelism in ``megatron-slim train`` (``parallel.cp > 1``
with a CP engine): each CP rank runs the vocabulary exchanges within its pipeline group on its
share of every microbatch (the plan's attention layout, its labels cut alike), counts the loss
tokens over the CP group and scales its loss by the CP size. pp2 x cp2 (4 ranks), 1F1B: one step
equals the single-process per-document reference in the loss and in EVERY parameter gradient
(fp32), with Zeppelin's remap (uneven rows per CP rank) and with ring."""

import pytest

from megatron_slim.runtime.spawn import run_ranks
from tests.train.test_train_cp import EOD, MODEL, _recipe, _reference, _train, _window
from tests.train.test_train_cp_pipeline import PIPELINE_WINDOWS, _check_against_reference, run_cp_step


def vocab_pipeline_step(rank, world_size, cases, hardware_path, window_lengths, seed=1234):
    """``test_train_cp_pipeline.pipeline_step`` with the vocabulary on every pipeline rank."""
    from megatron_slim.megatron.model.gpt import build_rank_chunks
    from megatron_slim.megatron.model.parallel import init_model_parallel
    from megatron_slim.megatron.model.vocab_head import build_vocab_head
    from megatron_slim.megatron.slimpipe.schedule import SlimPipeSettings, make_forward_backward_func
    from megatron_slim.train.cp import CPTrainStep, cp_layer_classes
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
        head = build_vocab_head(chunks, groups)
        settings = SlimPipeSettings((MODEL["seq_length"],), kind="1f1b")
        fb = make_forward_backward_func(settings, vocab_head=head, stage_rows=step.stage_rows)
        run = run_cp_step(fb, step.vocab_forward_step, step, chunks, groups, windows, head.reduce_grads)
        results[engine, remap] = {**run, "summary": step.summary()}
    if rank == 0:
        results["reference"] = _reference(recipe.model, solo, windows, seed)
    return results


@pytest.mark.multi
def test_pp2_cp2_vocab_parallel_step_matches_the_per_document_reference(hardware):
    cases = [("zeppelin", True), ("ring", False)]
    results = run_ranks(vocab_pipeline_step, 4, cases, hardware, PIPELINE_WINDOWS, timeout_s=600)
    zeppelin = results[0]["zeppelin", True]["summary"]
    assert zeppelin["min_tokens_per_rank"] != zeppelin["max_tokens_per_rank"]  # uneven rows per CP rank
    _check_against_reference(results, cases)


# slow tier: the gloo step above checks the same pp2 x cp2 exchange against the reference, and
# tests/train/test_train_cp_pipeline.py runs train's CP-engine pipeline from the CLI
@pytest.mark.slow
@pytest.mark.multi
def test_cli_trains_pp2_cp2_vocab_parallel_to_the_losses_without_it(tmp_path, data_cache, short_documents, hardware):
    sets = ["parallel.cp=2", "parallel.pp=2", "cp.engine=zeppelin", "cp.remap=true", f"hardware={hardware}"]
    spread = _train(tmp_path, "vocab", data_cache, short_documents, *sets, "schedule.vocab_parallel=true")
    plain = _train(tmp_path, "plain", data_cache, short_documents, *sets)
    assert len(spread["losses"]) == 4 and spread["losses"][-1] < spread["losses"][0]
    assert spread["losses"] == pytest.approx(plain["losses"], rel=1e-5, abs=0)
