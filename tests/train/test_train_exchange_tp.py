"""Context exchange in ``megatron-slim train`` under tensor parallelism.

Each TP rank holds a head shard of Q/K/V, and Megatron's pipeline group joins the same TP rank of
every stage, so a pair runs between the same TP rank of both stages, on that rank's heads; the
pairing (the plan) is the one tp=1 runs. pp2 x tp2 (4 gloo ranks; pp2 x cp2 x tp2, 8 ranks, in the
slow tier), tiny-cpu's model (RoPE, RMSNorm, SwiGLU, GQA with 2 query groups, split over tp=2): one
SlimPipe step through the training job's own pieces equals the single-process, unpipelined,
unsliced reference (run in a world of its own: Megatron's vocab-parallel loss reads the global TP
group) in the loss and in every parameter gradient (each TP rank against its shard of the whole
gradient). Not vacuous: every rank's shipped K/V rows equal the plan's block tokens it holds
(``oracle/zigzag_rows``: all of them at cp = 1) x layers over its stage's sender ends, and every
rank served one block per layer of each of its stage's taker ends. The CLI then trains pp2 x tp2
with exchange to the losses of the unsliced run.
Sequence parallelism is CUDA-only on CPU ranks (``parallel.sequence_parallel`` is refused there).
"""

import pytest
import torch

from megatron_slim.plan.schedule.exchange_blocks import ExchangePlan
from megatron_slim.runtime.spawn import run_ranks
from tests.oracle.reference import UNPIPELINED_UNSLICED
from tests.oracle.zigzag_rows import zigzag_rows
from tests.train._exchange_workers import slimpipe_exchange_step
from tests.train._tp_grads import TOL, assert_tp_shard_grads
from tests.train.test_train_exchange import COMMON, EXCHANGE
from tests.train.test_train_job import _train

MICROBATCHES, SEQ, SEED = 4, 128, 1234


def _recipe(pp: int, tp: int, cp: int):
    from megatron_slim.plan.recipe import load_recipe

    sizes = [f"parallel.pp={pp}", f"parallel.tp={tp}", f"parallel.cp={cp}", f"model.seq_length={SEQ}", "parallel.dp=1"]
    batch = [f"train.global_batch_size={MICROBATCHES}", "train.micro_batch_size=1", "train.precision=fp32"]
    return load_recipe("tiny-cpu", [*sizes, *batch, *EXCHANGE])


def reference_step(rank, world_size, pp, tp, cp):
    """The unpipelined, unsliced step on one rank: (token-weighted mean loss, whole-model grads)."""
    from megatron_slim.megatron.model.parallel import init_model_parallel
    from tests.oracle import reference
    from tests.runtime.pipeline._workers import make_batches

    model = _recipe(pp, tp, cp).model
    groups = init_model_parallel(seed=SEED)
    batches = make_batches(model, MICROBATCHES, micro_batch=1, seed=SEED)
    reports, grads = reference.unsliced_step(model, groups, batches, SEED)
    total = torch.stack(reports).sum(0)
    return total[0] / total[1], grads


def exchange_step(rank, world_size, pp, tp, cp, ref):
    """One train-path SlimPipe step with exchange on pp x tp x cp; returns this rank's coordinates, its
    loss pair, its grads and the reference's TP shard of them, the rows it shipped, the blocks it
    served and the pairing."""
    from megatron_slim.megatron.model.gpt import build_rank_chunks, global_grads, global_named_parameters
    from megatron_slim.megatron.model.parallel import init_model_parallel
    from megatron_slim.megatron.model.weights import tp_shard
    from megatron_slim.megatron.slimpipe.slicing import SliceCoreAttention
    from tests.runtime.pipeline._workers import make_batches

    recipe = _recipe(pp, tp, cp)
    groups = init_model_parallel(tp=tp, pp=pp, cp=cp, seed=SEED)
    batches = make_batches(recipe.model, MICROBATCHES, micro_batch=1, seed=SEED)
    chunks = build_rank_chunks(recipe.model, groups, core_attention=SliceCoreAttention, seed=SEED)
    fb, pair, pairing = slimpipe_exchange_step(recipe, groups, chunks, batches, MICROBATCHES, SEQ)
    params = {n: p for c in chunks for n, p in global_named_parameters(c).items()}
    return {
        "rank": (groups.pp_rank, groups.tp_rank, groups.cp_rank),
        "pair": pair,
        "grads": {n: g for c in chunks for n, g in global_grads(c).items()},
        "want": {n: tp_shard(ref[1][n], p, groups.tp_rank, tp) for n, p in params.items()},
        "sent": fb.stats.exchanged_tokens,
        "served": fb.stats.served_blocks,
        "pairing": pairing,
    }


def _check_exactness(results, ref, pp, tp, cp):
    ref_loss, ref_grads = ref
    assert_tp_shard_grads(results, ref_grads)
    last = [r for r in results if r["rank"][0] == pp - 1]
    assert len(last) == tp * cp
    for r in last:  # every TP rank reports the whole loss; CP ranks sum their tokens
        torch.testing.assert_close(r["pair"][0] / r["pair"][1], ref_loss, **TOL)


def _check_pairs_ran(results, pp, tp, cp):
    pairing = results[0]["pairing"]
    assert pairing and all(r["pairing"] == pairing for r in results), "ranks planned different pairs"
    plan = ExchangePlan.from_text(pairing)
    layers = _recipe(pp, tp, cp).model.num_layers // pp
    length = SEQ // 4  # test_train_exchange.EXCHANGE: 4 uniform slices
    shipped = {
        (s, c): sum(zigzag_rows(c, cp, length, p.kv_start, p.kv_end) * layers for p in plan.blocks if p.sender == s)
        for s in range(pp)
        for c in range(cp)
    }
    served = [sum(layers for p in plan.blocks if p.taker == s) for s in range(pp)]
    assert {r["rank"]: r["sent"] for r in results} == {
        (s, t, c): shipped[s, c] for s in range(pp) for t in range(tp) for c in range(cp)
    }
    assert {r["rank"]: r["served"] for r in results} == {
        (s, t, c): served[s] for s in range(pp) for t in range(tp) for c in range(cp)
    }
    assert sum(shipped.values()) > 0 and sum(served) > 0
    assert any(p.sender_action.kind.is_backward for p in plan.blocks), "no backward pair exercised"


@pytest.mark.multi
@pytest.mark.parametrize(
    "pp,tp,cp",
    [(2, 2, 1), pytest.param(2, 2, 2, marks=pytest.mark.slow)],
    ids=["pp2xtp2", "pp2xtp2xcp2"],
)
def test_train_step_with_exchange_under_tp_matches_the_single_process_reference(pp, tp, cp):
    model = _recipe(pp, tp, cp).model
    assert model.num_query_groups % tp == 0 and model.num_query_groups < model.num_attention_heads  # GQA, split
    ref = run_ranks(reference_step, 1, pp, tp, cp)[0]
    results = run_ranks(exchange_step, pp * tp * cp, pp, tp, cp, ref, timeout_s=900)
    _check_exactness(results, ref, pp, tp, cp)
    _check_pairs_ran(results, pp, tp, cp)


@pytest.mark.multi
@pytest.mark.slow  # train runs on their ranks (minutes)
def test_cli_trains_pp2_tp2_with_exchange_to_the_unpipelined_losses(tmp_path, data_cache):
    reference = _train(tmp_path, "reference", data_cache, *COMMON, *UNPIPELINED_UNSLICED)
    run = _train(tmp_path, "exchange-tp", data_cache, *COMMON, "parallel.pp=2", "parallel.tp=2", *EXCHANGE)
    assert run["losses"] == pytest.approx(reference["losses"], rel=1e-6, abs=0)
    assert max(reference["losses"]) - min(reference["losses"]) > 0.02  # updates move the loss past the tolerance
    assert run["stages"][1]["exchanged_tokens"] > 0  # stage 1 sends forward blocks
