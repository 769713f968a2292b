"""``schedule.vocab_parallel`` in ``megatron-slim train`` under tensor parallelism.

Megatron splits the vocabulary over the TP group; the vocabulary exchange splits each TP rank's
part over its pipeline group (the same TP rank of every stage), so pp2 x tp2 gives each of the 4
ranks a quarter of the vocabulary; the loss's max, exponential sum and target logit, the output
layer's hidden-state gradient and the embedding rows sum over both groups. One SlimPipe step through
the training job's own pieces (tiny-cpu: RoPE, RMSNorm, SwiGLU, GQA with 2 query groups split over
tp=2) equals the single-process, unpipelined, unsliced reference in the loss and in every parameter
gradient (each TP rank against its shard of the whole gradient), untied and tied. The CLI then
trains pp2 x tp2 with vocab_parallel to the losses of the unpipelined run.
"""

import pytest
import torch

from megatron_slim.runtime.spawn import run_ranks
from tests.oracle.reference import UNPIPELINED_UNSLICED
from tests.train._tp_grads import TOL, assert_tp_shard_grads
from tests.train.test_train_job import _train
from tests.train.test_train_vocab import COMMON, VOCAB_PP2

MICROBATCHES, SEQ, SEED, PP, TP = 4, 128, 1234, 2, 2


def _recipe(tied: bool):
    from megatron_slim.plan.recipe import load_recipe

    sets = [f"parallel.pp={PP}", f"parallel.tp={TP}", f"model.seq_length={SEQ}", "parallel.dp=1"]
    sets += [f"train.global_batch_size={MICROBATCHES}", "train.micro_batch_size=1", "train.precision=fp32"]
    sets += [f"model.untie_embeddings_and_output_weights={str(not tied).lower()}", *VOCAB_PP2[1:]]
    return load_recipe("tiny-cpu", sets)


def reference_step(rank, world_size, tied):
    """The unpipelined, unsliced step on one rank: (token-weighted mean loss, whole-model grads)."""
    from megatron_slim.megatron.model.parallel import init_model_parallel
    from tests.oracle import reference
    from tests.runtime.pipeline._workers import make_batches

    model = _recipe(tied).model
    groups = init_model_parallel(seed=SEED)
    batches = make_batches(model, MICROBATCHES, micro_batch=1, seed=SEED)
    reports, grads = reference.unsliced_step(model, groups, batches, SEED)
    total = torch.stack(reports).sum(0)
    return total[0] / total[1], grads


def vocab_step(rank, world_size, tied, ref):
    """One train-path SlimPipe step with the vocabulary exchange on pp2 x tp2: this rank's
    coordinates, loss pair, grads, the reference's TP shard of them and its vocabulary ids."""
    from megatron_slim.megatron.model.gpt import build_rank_chunks
    from megatron_slim.megatron.model.parallel import init_model_parallel
    from megatron_slim.megatron.model.vocab_head import build_vocab_head
    from megatron_slim.megatron.model.weights import global_grads, global_named_parameters, tp_shard
    from megatron_slim.megatron.slimpipe.schedule import make_forward_backward_func
    from megatron_slim.megatron.slimpipe.slicing import SliceCoreAttention
    from megatron_slim.runtime.pipeline.slice_context import SliceContext
    from megatron_slim.train.loop import pipeline_settings
    from megatron_slim.train.microbatch import vocab_forward_step
    from tests.runtime.pipeline._workers import make_batches

    recipe = _recipe(tied)
    groups = init_model_parallel(tp=TP, pp=PP, seed=SEED)
    batches = make_batches(recipe.model, MICROBATCHES, micro_batch=1, seed=SEED)
    chunks = build_rank_chunks(recipe.model, groups, core_attention=SliceCoreAttention, seed=SEED)
    head = build_vocab_head(chunks, groups)
    context = SliceContext(documents_on_every_tp_rank=True)
    fb = make_forward_backward_func(pipeline_settings(recipe), context=context, vocab_head=head)
    reports = fb(
        forward_step_func=vocab_forward_step,
        data_iterator=[iter(batches)],
        model=chunks,
        num_microbatches=MICROBATCHES,
        seq_length=SEQ,
        micro_batch_size=1,
    )
    head.reduce_grads()
    params = {n: p for c in chunks for n, p in global_named_parameters(c).items()}
    return {
        "rank": (groups.pp_rank, groups.tp_rank),
        "pair": torch.stack([r["lm loss"] for r in reports]).sum(0) if reports else None,
        "grads": {n: g for c in chunks for n, g in global_grads(c).items()},
        "want": {n: tp_shard(ref[1][n], p, groups.tp_rank, TP) for n, p in params.items()},
        "ids": head.lookup_head.ids_of(head.index),
    }


@pytest.mark.multi
@pytest.mark.slow  # 4 gloo ranks and a reference: about 50 s each on a shared 2-core box
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_vocab_parallel_step_under_tp_matches_the_single_process_reference(tied):
    model = _recipe(tied).model
    assert model.num_query_groups % TP == 0 and model.num_query_groups < model.num_attention_heads  # GQA, split
    ref = run_ranks(reference_step, 1, tied)[0]
    results = run_ranks(vocab_step, PP * TP, tied, ref, timeout_s=900)
    assert_tp_shard_grads(results, ref[1])
    for r in results:  # only the last stage reports; every TP rank of it the whole loss
        assert (r["pair"] is not None) == (r["rank"][0] == PP - 1)
        if r["pair"] is not None:
            torch.testing.assert_close(r["pair"][0] / r["pair"][1], ref[0], **TOL)
    quarter = model.vocab_size // (PP * TP)  # each rank looked its own quarter of the ids up
    assert sorted(r["ids"] for r in results) == [(q * quarter, (q + 1) * quarter) for q in range(PP * TP)]


@pytest.mark.multi
@pytest.mark.slow  # train runs on their ranks (minutes)
def test_cli_trains_pp2_tp2_with_vocab_parallel_to_the_unpipelined_losses(tmp_path, data_cache):
    reference = _train(tmp_path, "reference", data_cache, *COMMON, *UNPIPELINED_UNSLICED)
    run = _train(tmp_path, "vocab-tp", data_cache, *COMMON, *VOCAB_PP2, "parallel.tp=2")
    assert run["losses"] == pytest.approx(reference["losses"], rel=1e-6, abs=0)
    assert max(reference["losses"]) - min(reference["losses"]) > 0.02  # updates move the loss past the tolerance
