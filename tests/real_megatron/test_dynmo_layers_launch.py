"""Early exit (``--dynmo-exit-threshold``), mixture of depths (``--dynmo-mod-capacity``) and pruning
(``--dynmo-prune``) through ``python -m megatron_slim.launch`` on Megatron-LM's own
``pretrain_gpt.py`` (its 1F1B schedule and DDP), pp=2 on CPU gloo ranks.

What each option changes is measured by the launcher's token counts (forward pre-hooks on every
decoder layer and on its MLP, logged per layer): with early exit the layers before
``--dynmo-exit-from-layer`` run every token and the later ones fewer and fewer (an exited token
stays exited, across the stage boundary too); with mixture of depths every odd layer runs exactly
``floor(capacity * seq_length)`` tokens of each sequence and the others all of them, and the router
trains (its weights change every step). Pruning (pp=2 x dp=2, distributed optimizer, weight decay
0.1) keeps, after every step, exactly the neurons the cubic schedule leaves (counted from the weights
after the optimizer step, so a pruned weight that any update moved would count), while the layers
keep training.
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


def _run(tmp_path, sets: list[str], env=None, nproc: int = 2, iters: int = ITERS):
    corpus = write_corpus(tmp_path / "corpus")
    sets = TINY + ["parallel.pp=2", f"train.global_batch_size={GLOBAL_BATCH}", f"train.iters={iters}", *sets]
    sets += ["schedule.kind=1f1b", "schedule.num_slices=1", "train.log_interval=1"]
    run = run_pretrain(nproc, megatron_args(sets), tmp_path / "run", launcher=True, data_prefix=corpus, env=env)
    assert len(run.losses) == iters and run.skipped == 0
    assert all(loss == loss and loss < 10 for loss in run.losses), run.losses  # finite, near ln(vocab)
    return run


def _layer_weights(record_dir, nproc: int) -> dict[int, dict[int, dict]]:
    """rank -> iteration -> {layer: {parameter: digest}}."""
    out: dict[int, dict[int, dict]] = {}
    for rank in range(nproc):
        for line in (record_dir / f"rank{rank}.jsonl").read_text().splitlines():
            record = json.loads(line)
            if record["kind"] == "layer_weights":
                out.setdefault(rank, {})[record["iteration"]] = {int(k): v for k, v in record["layers"].items()}
    return out


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
    routers = {
        layer: [by_iteration[i][layer]["mod_router.weight"] for i in sorted(by_iteration)]
        for by_iteration in _layer_weights(tmp_path / "run" / "records", 2).values()
        for layer in by_iteration[1]
        if "mod_router.weight" in by_iteration[1][layer]
    }
    assert sorted(routers) == [1, 3, 5, 7]
    for layer, series in routers.items():
        assert len(series) == ITERS and all(a != b for a, b in zip(series, series[1:])), layer


PRUNED = re.compile(r"dynmo pruning at iteration (\d+) \(rank \d+\): layer (\d+) keeps (\d+) of (\d+) FFN neurons")


def test_pruning_keeps_the_scheduled_neurons_under_the_distributed_optimizer(tmp_path):
    sets = ["parallel.dp=2", "train.distributed_optimizer=true", "train.weight_decay=0.1", 'dynmo.prune="2-4:0.5"']
    run = _run(tmp_path, sets, env={"MEGATRON_SLIM_TEST_LAYER_WEIGHTS": "1"}, nproc=4, iters=4)
    kept: dict[int, dict[int, int]] = {}
    for iteration, layer, keeps, ffn in PRUNED.findall(run.log):
        assert int(ffn) == 64
        kept.setdefault(int(iteration), {})[int(layer)] = int(keeps)
    # Zhu & Gupta's cubic ramp from iteration 2 to 4 up to 0.5, written out: s(3) = 0.5 * (1 - 0.5**3)
    expected = {1: 64, 2: 64, 3: 64 - int(0.4375 * 64), 4: 32}
    assert kept == {iteration: dict.fromkeys(range(8), n) for iteration, n in expected.items()}, kept
    for rank, by_iteration in _layer_weights(tmp_path / "run" / "records", 4).items():
        for layer in by_iteration[1]:
            series = [by_iteration[i][layer]["mlp.linear_fc2.weight"] for i in range(1, 5)]
            assert all(a != b for a, b in zip(series, series[1:])), (rank, layer)  # the kept neurons train
