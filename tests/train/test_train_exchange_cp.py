"""Context exchange in ``megatron-slim train`` under context parallelism (``Recipe.exchange_cp``) and
under activation recomputation, with and without interleaving.

pp2 x cp2 (4 gloo ranks; pp4 x cp2, 8 ranks, and pp4 with ``train.recompute=full``, 4 ranks, and
pp4 x cp2 with it, 8 ranks, in the slow tier) and pp2 x vpp2 with ``train.recompute=full`` (and
``selective``, slow tier; 2 ranks; block plans in
both passes, some across model chunks), tiny-cpu's model: one SlimPipe step through the training
job's own pieces -- ``pipeline_settings`` (the plan ``megatron-slim simulate`` prices), SlimPipe's
slice attention on every chunk (Megatron's recomputation around it), ``packed.zigzag_cp_forward_step``
(each slice of a plain causal window split zigzag-wise over the CP ranks), the data x context
gradient average -- equals the single-process, unpipelined, unsliced, un-CP reference in the loss and
in EVERY parameter gradient (fp32; RoPE, RMSNorm, SwiGLU, GQA). Not vacuous: every rank's shipped K/V
rows equal the block tokens in its zigzag chunks (``oracle/zigzag_rows``) x layers of a model chunk
over its stage's sender ends, some
are positive, and the plan holds backward blocks (under recomputation these meet on the graph a
recomputed, unexchanged forward built). The CLI then trains pp2 x cp2 with exchange to the losses of
the pp1, cp1, unsliced run."""

import pytest
import torch

from megatron_slim.plan.schedule.exchange_blocks import ExchangePlan
from megatron_slim.runtime.spawn import run_ranks
from tests.oracle.reference import UNPIPELINED_UNSLICED
from tests.oracle.zigzag_rows import zigzag_rows
from tests.train._exchange_workers import slimpipe_exchange_step
from tests.train.test_train_exchange import COMMON, EXCHANGE
from tests.train.test_train_job import _train

MICROBATCHES, SEQ = 4, 128
EXCHANGE_SLICES = 4  # test_train_exchange.EXCHANGE's schedule.num_slices
TOL = dict(atol=2e-5, rtol=1e-4)


def _recipe(pp: int, cp: int, recompute: str, vpp: int = 1):
    from megatron_slim.plan.recipe import load_recipe

    sizes = [
        f"parallel.pp={pp}",
        f"parallel.vpp={vpp}",
        f"parallel.cp={cp}",
        f"model.seq_length={SEQ}",
        "parallel.dp=1",
    ]
    batch = [f"train.global_batch_size={MICROBATCHES}", "train.micro_batch_size=1", "train.precision=fp32"]
    return load_recipe("tiny-cpu", [*sizes, *batch, f"train.recompute={recompute}", *EXCHANGE])


def exchange_step(rank, world_size, pp, cp, recompute, vpp=1, seed=1234):
    """One train-path SlimPipe step with exchange on pp x vpp x cp (``train.recompute=recompute``); returns
    this rank's DDP-averaged grads by global name, the (loss sum, token count) over the CP group (last
    stage), the K/V rows it shipped and the pairing; on rank 0 also the reference (loss, grads)."""
    from megatron_slim.megatron.model.gpt import build_rank_chunks, global_grads
    from megatron_slim.megatron.model.parallel import init_model_parallel
    from megatron_slim.megatron.model.recompute import recompute_config
    from megatron_slim.megatron.slimpipe.slicing import SliceCoreAttention
    from tests.oracle import reference
    from tests.runtime.pipeline._workers import make_batches

    recipe = _recipe(pp, cp, recompute, vpp)
    assert recipe.exchange_cp == recipe.query_out_cp == (cp > 1)
    groups = init_model_parallel(pp=pp, cp=cp, vpp=vpp)
    solo = reference.solo_groups(rank, world_size)
    batches = make_batches(recipe.model, MICROBATCHES, micro_batch=1, seed=seed)
    recomputed = recompute_config(recipe.train.recompute_plan)
    chunks = build_rank_chunks(recipe.model, groups, core_attention=SliceCoreAttention, seed=seed, **recomputed)
    fb, pair, pairing = slimpipe_exchange_step(recipe, groups, chunks, batches, MICROBATCHES, SEQ)
    out = {
        "pp_rank": groups.pp_rank,
        "cp_rank": groups.cp_rank,
        "grads": {n: g for c in chunks for n, g in global_grads(c).items()},
        "pair": pair,
        "sent": fb.stats.exchanged_tokens,
        "pairing": pairing,
    }
    if rank == 0:
        ref_reports, ref_grads = reference.unsliced_step(recipe.model, solo, batches, seed)
        total = torch.stack(ref_reports).sum(0)
        out["reference"] = (total[0] / total[1], ref_grads)
    return out


def _check_exactness(results, pp, cp):
    ref_loss, ref_grads = results[0]["reference"]
    got = {}
    for r in results:
        if r["cp_rank"] == 0:
            got.update(r["grads"])
    assert got.keys() == ref_grads.keys()
    for name, want in ref_grads.items():
        torch.testing.assert_close(got[name], want, **TOL, msg=lambda m, name=name: f"{name}: {m}")
    last = [r for r in results if r["pp_rank"] == pp - 1]
    assert len(last) == cp
    for r in last:  # the CP-summed [loss, tokens] reports give the token-weighted mean loss
        torch.testing.assert_close(r["pair"][0] / r["pair"][1], ref_loss, **TOL)


def _check_pairs_ran(results, pp, cp, vpp=1):
    pairing = results[0]["pairing"]
    assert pairing and all(r["pairing"] == pairing for r in results), "ranks planned different pairs"
    plan = ExchangePlan.from_text(pairing)
    layers = _recipe(pp, cp, "none", vpp).model.num_layers // (pp * vpp)  # attention layers of one model chunk
    length = SEQ // EXCHANGE_SLICES  # uniform slices
    shipped = {
        (s, c): sum(zigzag_rows(c, cp, length, p.kv_start, p.kv_end) * layers for p in plan.blocks if p.sender == s)
        for s in range(pp)
        for c in range(cp)
    }
    sent = {(r["pp_rank"], r["cp_rank"]): r["sent"] for r in results}
    assert sent == shipped and sum(shipped.values()) > 0
    assert any(p.sender_action.kind.is_backward for p in plan.blocks), "no backward pair exercised"
    if vpp > 1:
        assert any(p.sender_action.chunk != p.taker_action.chunk for p in plan.blocks), "no cross-chunk block"


@pytest.mark.multi
@pytest.mark.parametrize(
    "pp,cp,recompute,vpp",
    [
        # slow: exchange under query-out CP is exact in the default tier in the runtime
        # (tests/runtime/pipeline/test_exchange_blocks_cp_exactness.py), and through this train step below
        pytest.param(2, 2, "none", 1, marks=pytest.mark.slow),
        pytest.param(4, 2, "none", 1, marks=pytest.mark.slow),
        pytest.param(4, 1, "full", 1, marks=pytest.mark.slow),  # backward pairs on a recomputed forward's graph
        pytest.param(4, 2, "full", 1, marks=pytest.mark.slow),  # the same under zigzag query-out CP
        (2, 1, "full", 2),  # group plans across model chunks, served beside recomputed layers
        pytest.param(2, 1, "selective", 2, marks=pytest.mark.slow),  # the full case covers vpp with recompute
    ],
    ids=[
        "pp2xcp2",
        "pp4xcp2",
        "pp4-recompute-full",
        "pp4xcp2-recompute-full",
        "pp2xvpp2-recompute-full",
        "pp2xvpp2-recompute-selective",
    ],
)
def test_train_step_with_exchange_matches_the_single_process_reference(pp, cp, recompute, vpp):
    results = run_ranks(exchange_step, pp * cp, pp, cp, recompute, vpp, timeout_s=900)
    _check_exactness(results, pp, cp)
    _check_pairs_ran(results, pp, cp, vpp)


@pytest.mark.multi
@pytest.mark.slow  # train runs on their ranks (minutes)
def test_cli_trains_pp2_cp2_with_exchange_to_the_unpipelined_losses(tmp_path, data_cache):
    reference = _train(tmp_path, "reference", data_cache, *COMMON, *UNPIPELINED_UNSLICED)
    run = _train(tmp_path, "exchange-cp", data_cache, *COMMON, "parallel.pp=2", "parallel.cp=2", *EXCHANGE)
    assert run["losses"] == pytest.approx(reference["losses"], rel=1e-6, abs=0)
    assert max(reference["losses"]) - min(reference["losses"]) > 0.02  # updates move the loss past the tolerance
    assert run["cp"] == {"size": 2, "engine": None, "attention": "slimpipe-query-out", "document_masking": False}
    assert run["stages"][1]["exchanged_tokens"] > 0  # stage 1 sends forward blocks
