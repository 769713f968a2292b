"""``--slimpipe-offload-ratio`` through the real ``pretrain_gpt.py``: SlimPipe (2 slices) holding a
share of each slice's decoder-layer activations in host memory trains exactly as the same run
without offload (lm loss and grad norm per iteration, relative difference <= 1e-5, fp32; CPU kernels
are deterministic and the offloaded tensors come back bit for bit), and every rank reports that it
moved activations to host memory. Cases: pp2 with ratio 0.5 (2 of each stage's 4 layers), pp2 with
block recomputation of 1 layer and ratio 0.5 (2 of the other 3), pp2 x cp2 under SlimPipe's
query-out context parallelism and under zeppelin's planned slices, and pp2 x cp2 with context
exchange on 4 uniform slices (the combination the autotuner chooses for Llama-2-70B; the only case
of the default tier, the others run in ``make test-slow``)."""

from __future__ import annotations

import re

import pytest

from tests.real_megatron.harness import TINY, assert_trains_as, megatron_args, run_pretrain, write_corpus

pytestmark = pytest.mark.real_megatron
TOLERANCE = 1e-5
REPORT = re.compile(r"megatron-slim: activation offload on rank (\d+): (\d+) bytes held in host memory")
BLOCK = ["train.recompute=full", "train.recompute_method=block", "train.recompute_num_layers=1"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus") / "docs")


EXCHANGE = ["schedule.slice_policy=exchange", "schedule.num_slices=4"]


def _flags(cp: int, extra: list[str], ratio: float, engine: str) -> list[str]:
    sets = [
        "parallel.pp=2",
        f"parallel.cp={cp}",
        f"cp.engine={engine}",
        "schedule.kind=slimpipe",
        "schedule.num_slices=2",
    ]
    return megatron_args([*TINY, *sets, *extra, f"train.offload_ratio={ratio}"])


@pytest.mark.parametrize(
    "cp, extra, engine",
    [
        pytest.param(1, [], "ring", id="pp2", marks=pytest.mark.slow),
        pytest.param(1, BLOCK, "ring", id="pp2-recompute-block", marks=pytest.mark.slow),
        pytest.param(2, [], "ring", id="pp2xcp2", marks=pytest.mark.slow),
        pytest.param(2, [], "zeppelin", id="pp2xcp2-zeppelin-slices", marks=pytest.mark.slow),
        pytest.param(2, EXCHANGE, "ring", id="pp2xcp2-exchange"),  # the tuner's combination; the rest: make test-slow
    ],
)
def test_offload_trains_as_the_run_without_it_and_moves_activations(
    cp, extra, engine, corpus, tmp_path, report_measurement
):
    flags = _flags(cp, extra, 0.5, engine)
    assert flags[flags.index("--slimpipe-offload-ratio") + 1] == "0.5"
    plain_flags = _flags(cp, extra, 0.0, engine)
    assert "--slimpipe-offload-ratio" not in plain_flags
    ranks = 2 * cp
    offload = run_pretrain(ranks, flags, tmp_path / "offload", launcher=True, data_prefix=corpus)
    plain = run_pretrain(ranks, plain_flags, tmp_path / "plain", launcher=True, data_prefix=corpus)

    assert "0.5 of the layers' activations offloaded" in offload.log
    loss_diff, norm_diff = assert_trains_as(offload, plain, TOLERANCE)
    moved = {int(rank): int(nbytes) for rank, nbytes in REPORT.findall(offload.log)}
    assert sorted(moved) == list(range(ranks)), offload.log[-3000:]
    assert all(nbytes > 0 for nbytes in moved.values()), moved
    assert "activation offload on rank" not in plain.log
    if extra is EXCHANGE:
        assert "4 exchange slice(s)" in offload.log
    label = {id(BLOCK): " block recompute", id(EXCHANGE): " exchange"}.get(id(extra), "")
    layout = f"pp2xcp{cp}" + (f" {engine} slices" if engine != "ring" else "") + label
    report_measurement(
        f"{layout} offload 0.5 vs none: lm loss {loss_diff:.1e}, grad norm {norm_diff:.1e}; "
        f"bytes held in host memory per rank in the first training call: {moved}"
    )
