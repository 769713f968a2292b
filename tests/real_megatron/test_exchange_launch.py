"""Context exchange under Megatron-LM's own ``pretrain()``: ``python -m megatron_slim.launch
pretrain_gpt.py ... --use-slimpipe --slimpipe-slice-policy exchange`` against the same run with
uniform slices (what exchange keeps), iteration by iteration (lm loss and grad norm, relative
difference <= 1e-5, fp32): moving attention blocks between pipeline ranks changes only the order of
the softmax's sums.

Cases: pp2, pp4 (forward and backward pairs on every rank), pp2 x vpp2 (pairs across model
chunks), pp2 x cp2 (SlimPipe's zigzag query-out CP: no ``--cp-engine``, each CP rank ships its
shard) and pp2 under Megatron's ``--recompute-granularity full --recompute-method block
--recompute-num-layers 2`` (half of each stage's layers rebuilt in backward; also at pp2 x cp2,
slow tier) and pp2 under
``--recompute-granularity selective --recompute-modules core_attn mlp`` (a recomputed forward is not
paired, so the counts are the plan's for the flags), pp2 x tp2 (each pair between the same TP rank of
both stages; every TP rank of a stage ships the same rows, its own heads of them) and pp2 x tp2 with
``--sequence-parallel`` (attention sees the gathered sequence). The sequence is 512 tokens
(4 slices of 128), so the group plan (``timed_exchange_schedule`` on the flags' recipe, the one
``megatron-slim simulate`` and ``train`` use) moves blocks worth their transfers. Each rank reports
what its exchange did in the first training call; they must equal, rank by rank (pipeline rank =
global rank // (tp * cp)), what the plan holds for the run's flags (``expected_reports``, from the
plan value alone): K/V shipped by senders, blocks served by takers.
"""

from __future__ import annotations

import argparse
import math
import re

import pytest

from megatron_slim.megatron.launch.args import recipe_from_megatron_args
from megatron_slim.plan.schedule.exchange_blocks import ExchangePlan
from megatron_slim.plan.sim.exchange_timing import timed_exchange_schedule
from tests.oracle.zigzag_rows import zigzag_rows
from tests.real_megatron.harness import (
    TINY,
    VOCAB,
    assert_trains_as,
    installed_megatron_core,
    megatron_args,
    run_pretrain,
    write_corpus,
)

pytestmark = pytest.mark.real_megatron
TOLERANCE = 1e-5
SLICES, SEQ = 4, 512
REPORT = re.compile(
    r"megatron-slim: context exchange on rank (\d+): (\d+) K/V tokens shipped, (\d+) attention blocks served"
)


RECOMPUTE_ARGS = {
    "": {},
    "block": {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 2},
    "selective": {"recompute_granularity": "selective", "recompute_modules": ["core_attn", "mlp"]},
}
RECOMPUTE_SETS = {
    "": [],
    "block": ["train.recompute=full", "train.recompute_method=block", "train.recompute_num_layers=2"],
    "selective": ["train.recompute=selective", "train.recompute_modules=core_attn,mlp"],
}


def expected_reports(
    pp: int, vpp: int = 1, cp: int = 1, recompute: str = "", tp: int = 1, sp: bool = False
) -> dict[int, tuple[int, int]]:
    """Per global rank, (K/V tokens shipped, attention blocks served) in one training call of the
    block plan ``timed_exchange_schedule`` makes for this run's flags: every block meets once per
    attention layer of a model chunk, each CP rank shipping the block's tokens in its zigzag chunks
    (``oracle/zigzag_rows``) and every
    TP rank of a stage the same rows (its own heads of them). Megatron
    pads NullTokenizer's vocabulary (up to core 0.16 the eod id comes after it) to a multiple of 128
    times the tensor-parallel size, and the cost model reads the padded size."""
    vocab = VOCAB + (1 if installed_megatron_core() < (0, 17) else 0)
    multiple = 128 * tp  # Megatron's --make-vocab-size-divisible-by default, per TP rank
    args = argparse.Namespace(
        num_layers=8, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
        group_query_attention=True, padded_vocab_size=multiple * math.ceil(vocab / multiple), seq_length=SEQ,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp, sequence_parallel=sp, **RECOMPUTE_ARGS[recompute],
        global_batch_size=4, micro_batch_size=1, slimpipe_hardware="cpu", slimpipe_num_slices=SLICES,
        slimpipe_slice_policy="exchange",
    )  # fmt: skip
    uniform = (SEQ // SLICES,) * SLICES
    plan = ExchangePlan.from_text(timed_exchange_schedule(recipe_from_megatron_args(args), 4, uniform).exchange)
    layers, reports = 8 // (pp * vpp), {}
    for rank in range(pp * cp * tp):  # Megatron's rank order is tp-cp-dp-pp
        stage, cp_rank = rank // (tp * cp), rank // tp % cp
        sent = [zigzag_rows(cp_rank, cp, SEQ // SLICES, b.kv_start, b.kv_end) for b in plan.blocks if b.sender == stage]
        reports[rank] = (sum(sent) * layers, sum(layers for b in plan.blocks if b.taker == stage))
    return reports


def _flags(pp: int, vpp: int, cp: int, recompute: str, policy: str, tp: int = 1, sp: bool = False) -> list[str]:
    sets = [f"parallel.pp={pp}", f"parallel.vpp={vpp}", f"model.seq_length={SEQ}", "schedule.kind=slimpipe"]
    sets += [f"schedule.num_slices={SLICES}", f"parallel.cp={cp}", "cp.engine=ring"]  # ring: query-out CP
    sets += [f"parallel.tp={tp}"] + (["parallel.sequence_parallel=true"] if sp else [])
    return megatron_args([*TINY, *sets, *RECOMPUTE_SETS[recompute], f"schedule.slice_policy={policy}"])


@pytest.mark.parametrize(
    "pp, vpp, cp, recompute, tp, sp",
    [
        (2, 1, 1, "", 1, False),
        (4, 1, 1, "", 1, False),
        (2, 2, 1, "", 1, False),
        (2, 1, 2, "", 1, False),
        (2, 1, 1, "block", 1, False),
        pytest.param(2, 1, 2, "block", 1, False, marks=pytest.mark.slow),  # query-out CP under recomputation
        pytest.param(2, 1, 1, "selective", 1, False, marks=pytest.mark.slow),  # block covers the recompute path
        (2, 1, 1, "", 2, False),
        pytest.param(2, 1, 1, "", 2, True, marks=pytest.mark.slow),  # pp2xtp2 covers the TP pairs
    ],
    ids=[
        "pp2", "pp4", "pp2xvpp2", "pp2xcp2", "pp2-recompute-block", "pp2xcp2-recompute-block",
        "pp2-recompute-selective", "pp2xtp2",
        "pp2xtp2-sequence-parallel",
    ],
)  # fmt: skip
def test_exchange_trains_as_uniform_slices_and_its_pairs_run(
    pp, vpp, cp, recompute, tp, sp, tmp_path, report_measurement
):
    corpus = write_corpus(tmp_path / "docs", documents=2000)  # validation needs whole 512-token windows
    flags, ranks = _flags(pp, vpp, cp, recompute, "exchange", tp, sp), pp * cp * tp
    assert flags[flags.index("--slimpipe-slice-policy") + 1] == "exchange" and "--cp-engine" not in flags
    granularity = flags[flags.index("--recompute-granularity") + 1] if "--recompute-granularity" in flags else ""
    assert granularity == {"": "", "block": "full", "selective": "selective"}[recompute]
    assert flags[flags.index("--tensor-model-parallel-size") + 1] == str(tp) and ("--sequence-parallel" in flags) == sp
    exchange = run_pretrain(ranks, flags, tmp_path / "exchange", launcher=True, data_prefix=corpus)
    uniform_flags = _flags(pp, vpp, cp, recompute, "uniform", tp, sp)
    uniform = run_pretrain(ranks, uniform_flags, tmp_path / "uniform", launcher=True, data_prefix=corpus)

    assert f"{SLICES} exchange slice(s)" in exchange.log
    loss_diff, norm_diff = assert_trains_as(exchange, uniform, TOLERANCE)

    reports = {int(rank): (int(shipped), int(served)) for rank, shipped, served in REPORT.findall(exchange.log)}
    assert sorted(reports) == list(range(ranks)), exchange.log[-3000:]
    assert sum(shipped for shipped, _ in reports.values()) > 0 and sum(s for _, s in reports.values()) > 0
    assert reports == expected_reports(pp, vpp, cp, recompute, tp, sp)
    assert "context exchange on rank" not in uniform.log
    report_measurement(
        f"pp{pp}xvpp{vpp}xcp{cp}xtp{tp}{' sequence parallel' if sp else ''}"
        f"{f' {recompute} recompute' if recompute else ''} exchange vs uniform slices: "
        f"lm loss {loss_diff:.1e}, grad norm {norm_diff:.1e}; "
        f"per rank (K/V tokens shipped, blocks served) in the first training call: {reports}"
    )
