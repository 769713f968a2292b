"""Early exit (``--dynmo-exit-threshold``) and mixture of depths (``--dynmo-mod-capacity``) through
``python -m megatron_slim.launch`` on Megatron-LM's own ``pretrain_gpt.py`` (its 1F1B schedule and
DDP), pp=2 on CPU gloo ranks.

What each option changes is measured by the launcher's token counts (forward pre-hooks on every
decoder layer and on its MLP, logged per layer): with early exit the layers before
``--dynmo-exit-from-layer`` run every token and the later ones fewer and fewer (an exited token
stays exited, across the stage boundary too); with mixture of depths every odd layer runs exactly
``floor(capacity * seq_length)`` tokens of each sequence and the others all of them, and the router
trains (its weights change every step).
"""

from __future__ import annotations

import json
import re

import pytest

from tests.real_megatron.harness import TINY, megatron_args, run_pretrain, write_corpus

pytestmark = pytest.mark.real_megatron
ITERS, SEQ, GLOBAL_BATCH = 3, 64, 8
TOKENS = SEQ * GLOBAL_BATCH  # entering every layer in an iteration (dp=1)
LINE = re.compile(r"dynmo tokens at iteration (\d+) \(rank \d+\): layer (\d+) ran its MLP on (\d+) of (\d+) tokens")


def _token_counts(log: str) -> dict[int, dict[int, tuple[int, int]]]:
    """iteration -> layer -> (tokens through its MLP, tokens entering it)."""
    out: dict[int, dict[int, tuple[int, int]]] = {}
    for it, layer, computed, entered in LINE.findall(log):
        out.setdefault(int(it), {})[int(layer)] = (int(computed), int(entered))
    return out


def _run(tmp_path, sets: list[str], env=None):
    corpus = write_corpus(tmp_path / "corpus")
    sets = TINY + ["parallel.pp=2", f"train.global_batch_size={GLOBAL_BATCH}", f"train.iters={ITERS}", *sets]
    sets += ["schedule.kind=1f1b", "schedule.num_slices=1", "train.log_interval=1"]
    run = run_pretrain(2, megatron_args(sets), tmp_path / "run", launcher=True, data_prefix=corpus, env=env)
    assert len(run.losses) == ITERS and run.skipped == 0
    assert all(loss == loss and loss < 10 for loss in run.losses), run.losses  # finite, near ln(vocab)
    return run


def test_early_exit_runs_fewer_tokens_through_later_layers(tmp_path):
    run = _run(tmp_path, ["dynmo.exit_threshold=0.12", "dynmo.exit_from_layer=2"])
    counts = _token_counts(run.log)
    assert sorted(counts) == list(range(1, ITERS + 1))
    for iteration, layers in counts.items():
        assert sorted(layers) == list(range(8))
        assert all(entered == TOKENS for _, entered in layers.values()), layers
        assert layers[0][0] == layers[1][0] == TOKENS  # before --dynmo-exit-from-layer: every token
        computed = [layers[layer][0] for layer in range(2, 8)]
        assert all(a >= b for a, b in zip(computed, computed[1:])), (iteration, computed)  # exits are final
        assert 0 < computed[-1] < TOKENS, (iteration, computed)  # some tokens left, not all


def test_mixture_of_depths_routes_its_capacity_and_trains_the_router(tmp_path):
    run = _run(tmp_path, ["dynmo.mod_capacity=0.25"], env={"MEGATRON_SLIM_TEST_LAYER_WEIGHTS": "1"})
    counts = _token_counts(run.log)
    assert sorted(counts) == list(range(1, ITERS + 1))
    routed = (SEQ // 4) * GLOBAL_BATCH  # floor(0.25 * 64) tokens of each of the 8 sequences
    for layers in counts.values():
        assert layers == {layer: (routed if layer % 2 else TOKENS, TOKENS) for layer in range(8)}
    routers: dict[int, list[str]] = {}
    for rank in range(2):
        for line in (tmp_path / "run" / "records" / f"rank{rank}.jsonl").read_text().splitlines():
            record = json.loads(line)
            if record["kind"] == "layer_weights":
                for layer, params in record["layers"].items():
                    if "mod_router.weight" in params:
                        routers.setdefault(int(layer), []).append(params["mod_router.weight"])
    assert sorted(routers) == [1, 3, 5, 7]
    for layer, series in routers.items():
        assert len(series) == ITERS and all(a != b for a, b in zip(series, series[1:])), layer
