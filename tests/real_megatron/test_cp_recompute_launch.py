"""Megatron's activation recomputation under SlimPipe's zigzag query-out context parallelism through
the real ``pretrain_gpt.py`` (``python -m megatron_slim.launch``, no ``--cp-engine``): pp2 x cp2 (4
ranks), 4 uniform slices of each 64-token window, with ``--recompute-granularity full
--recompute-method uniform --recompute-num-layers 1`` and with ``--recompute-granularity selective
--recompute-modules core_attn mlp``: every iteration's lm loss and gradient norm equal, bit for bit,
those of the same run without recomputation (a recomputed slice's CP attention reads the K/V prefix
its forward cached and appends nothing; CPU kernels sum in the same order)."""

from __future__ import annotations

import pytest

from tests.real_megatron.harness import TINY, megatron_args, run_pretrain, write_corpus

pytestmark = pytest.mark.real_megatron
LAYOUT = ["parallel.pp=2", "parallel.cp=2", "schedule.kind=slimpipe", "schedule.num_slices=4", "cp.engine=ring"]
RECOMPUTE = {
    "full": ["train.recompute=full", "train.recompute_method=uniform", "train.recompute_num_layers=1"],
    "selective": ["train.recompute=selective", "train.recompute_modules=core_attn,mlp"],
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("docs"))


@pytest.fixture(scope="module")
def without(tmp_path_factory, corpus):
    flags = megatron_args([*TINY, *LAYOUT])
    assert "--cp-engine" not in flags and "--recompute-granularity" not in flags
    return run_pretrain(4, flags, tmp_path_factory.mktemp("none"), launcher=True, data_prefix=corpus)


@pytest.mark.parametrize("recompute", ["full", pytest.param("selective", marks=pytest.mark.slow)])
def test_recomputation_under_query_out_cp_trains_as_the_run_without(recompute, tmp_path, corpus, without):
    flags = megatron_args([*TINY, *LAYOUT, *RECOMPUTE[recompute]])
    assert "--cp-engine" not in flags and flags[flags.index("--recompute-granularity") + 1] == recompute
    assert flags[flags.index("--context-parallel-size") + 1] == "2"
    run = run_pretrain(4, flags, tmp_path, launcher=True, data_prefix=corpus)
    assert "4 uniform slice(s)" in run.log
    assert len(without.losses) == 3 and run.skipped == without.skipped == 0
    assert without.losses[-1] < without.losses[0]  # it trained
    assert run.losses == without.losses, (run.losses, without.losses)
    assert run.grad_norms == without.grad_norms, (run.grad_norms, without.grad_norms)
