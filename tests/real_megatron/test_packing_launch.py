"""``--slimpipe-packing`` through the real ``pretrain_gpt.py`` (``megatron/data/packed_windows.py``).

Independent check: the first iteration's loss and gradient norm are the global batch's per-token
mean loss and its gradient over the iteration's documents, so they cannot depend on how the
documents are laid out in windows or over DP ranks. slimpack and bfd take the same documents in
iteration 1 here (the logs' document and loss token counts are asserted equal) but lay them out
differently, and slimpack over 2 DP ranks lays them out differently again; Megatron seeds each
pipeline rank alike whatever the DP size, so the three start from the same weights. They agree only
if attention and RoPE positions stay inside each document (a neighbour in another window would
change a token's loss) and the loss is normalised by the global batch's token count (a per-window
or per-rank mean would weigh the windows' tokens differently). Lining the run up with ``megatron-slim
train`` instead is not possible: that command reads every document of the corpus (Megatron's
``--split`` keeps 90% for training) and initialises its model from its own seed stream.
"""

from __future__ import annotations

import re

import pytest

from tests.real_megatron.harness import TINY, megatron_args, relative_difference, run_pretrain, write_corpus

pytestmark = pytest.mark.real_megatron
TOLERANCE = 1e-5
SUMMARY = re.compile(
    r"megatron-slim: packing (\w+): ([\d/]+) microbatches per DP rank, .* (\d+) document tokens, "
    r"(\d+) loss tokens \(iteration 1\)"
)


def _flags(method: str, dp: int) -> list[str]:
    layout = ["parallel.pp=2", f"parallel.dp={dp}", "schedule.kind=slimpipe", "schedule.num_slices=2"]
    ours = megatron_args([*TINY, *layout, "train.iters=4"])
    return ours + ["--slimpipe-packing", method, "--calculate-per-token-loss"]


def _summary(log: str) -> tuple[str, ...]:
    found = SUMMARY.search(log)
    assert found, log[-3000:]
    return found.groups()


def test_packed_pretrain_gpt_trains_and_its_loss_does_not_depend_on_the_layout(tmp_path):
    corpus = write_corpus(tmp_path / "docs")
    runs = {}
    for method, dp in (("slimpack", 1), ("bfd", 1), ("slimpack", 2)):
        where = tmp_path / f"{method}-dp{dp}"
        runs[method, dp] = run_pretrain(2 * dp, _flags(method, dp), where, launcher=True, data_prefix=corpus)
    summaries = {key: _summary(run.log) for key, run in runs.items()}
    assert summaries["slimpack", 1][1] == "4" and summaries["slimpack", 2][1] == "2/2"
    assert len({s[2:] for s in summaries.values()}) == 1, summaries  # the same documents in iteration 1

    packed = runs["slimpack", 1]
    assert len(packed.losses) == 4 and packed.skipped == 0
    assert packed.losses[-1] < packed.losses[0] - 0.1, packed.losses  # it trains
    for key in (("bfd", 1), ("slimpack", 2)):
        other = runs[key]
        assert relative_difference(other.losses[:1], packed.losses[:1]) <= TOLERANCE, (key, other.losses)
        assert relative_difference(other.grad_norms[:1], packed.grad_norms[:1]) <= TOLERANCE, (key, other.grad_norms)


def test_a_packed_run_without_per_token_loss_stops_at_start_up(tmp_path):
    corpus = write_corpus(tmp_path / "docs", documents=40)
    flags = [f for f in _flags("slimpack", 1) if f != "--calculate-per-token-loss"]
    with pytest.raises(AssertionError, match="needs --calculate-per-token-loss"):
        run_pretrain(2, flags, tmp_path / "run", launcher=True, data_prefix=corpus)
