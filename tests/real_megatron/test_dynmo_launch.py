"""``--dynmo-profile`` and ``--dynmo-freeze`` through ``python -m megatron_slim.launch`` on Megatron-LM's
own ``pretrain_gpt.py`` (its 1F1B schedule, DDP and distributed optimizer, weight decay on), pp=2 x
dp=2 on CPU gloo ranks.

Frozen layers: from the freeze point on they skip their weight gradients (``requires_grad`` off,
``param.grad`` None and DDP's reduced ``main_grad`` exactly zero, so DDP's hook never fired) and
their weights are bit-identical (sha256 of their bytes, recorded by the shim's ``weights_recorder``
after each training step) from the step before the freeze point to the end, on every rank, while
they had gradients and changed before it and the other layers keep both.
Profile: every rank writes the smoothed per-layer profile of its layers and of the whole model.
Under ``--overlap-grad-reduce`` (dp=2) frozen layers keep computing weight gradients, which DDP's
buckets wait for, and the optimizer still leaves their weights bit-identical.
"""

from __future__ import annotations

import json

import pytest

from tests.real_megatron.harness import TINY, megatron_args, run_pretrain, write_corpus

pytestmark = pytest.mark.real_megatron
ITERS, FREEZE_AT, FROZEN = 5, 3, range(2, 6)  # layers 2-3 on the first stage, 4-5 on the second


def _weights(record_dir, nproc: int, kind: str = "layer_weights") -> dict[int, dict[int, dict]]:
    """rank -> iteration -> {layer: {parameter: digest (or gradient facts, for layer_grads)}}."""
    out: dict[int, dict[int, dict]] = {}
    for rank in range(nproc):
        for line in (record_dir / f"rank{rank}.jsonl").read_text().splitlines():
            record = json.loads(line)
            if record["kind"] == kind:
                out.setdefault(rank, {})[record["iteration"]] = {int(k): v for k, v in record["layers"].items()}
    return out


def test_frozen_layers_stay_bit_identical_and_every_layer_is_profiled(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    sets = TINY + ["parallel.pp=2", "parallel.dp=2", "train.global_batch_size=8", f"train.iters={ITERS}"]
    sets += ["train.distributed_optimizer=true", "train.weight_decay=0.1", "train.log_interval=2"]
    sets += ["schedule.kind=1f1b", "schedule.num_slices=1", "dynmo.profile=true"]
    sets += [f'dynmo.freeze="{FREEZE_AT}:{FROZEN.start}-{FROZEN.stop - 1}"']
    flags = megatron_args(sets)
    assert flags[flags.index("--dynmo-freeze") + 1] == "3:2-5" and "--dynmo-profile" in flags
    profile_dir = tmp_path / "profile"
    run = run_pretrain(
        4,
        flags + ["--dynmo-profile-dir", str(profile_dir)],
        tmp_path / "run",
        launcher=True,
        data_prefix=corpus,
        env={"MEGATRON_SLIM_TEST_LAYER_WEIGHTS": "1"},
    )
    assert len(run.losses) == ITERS and run.skipped == 0

    weights = _weights(tmp_path / "run" / "records", 4)
    assert sorted(weights) == [0, 1, 2, 3]
    for rank, by_iteration in weights.items():
        assert sorted(by_iteration) == list(range(1, ITERS + 1))
        for layer in by_iteration[1]:
            series = [by_iteration[i][layer] for i in range(1, ITERS + 1)]
            if layer in FROZEN:  # trained up to the step before FREEZE_AT, then never again
                assert series[FREEZE_AT - 3] != series[FREEZE_AT - 2], (rank, layer)
                assert all(s == series[FREEZE_AT - 2] for s in series[FREEZE_AT - 2 :]), (rank, layer)
            else:
                assert all(a != b for a, b in zip(series, series[1:])), (rank, layer)
    assert {layer for ranks in weights.values() for layer in ranks[1]} == set(range(8))
    assert "dynmo freeze: frozen layers skip their weight gradients" in run.log
    _assert_frozen_layers_had_no_gradient(_weights(tmp_path / "run" / "records", 4, "layer_grads"))

    assert "dynmo profile at iteration 4 (smoothed, per microbatch):" in run.log
    files = sorted(profile_dir.glob("layer_profile.rank*.json"))
    assert [f.name for f in files] == [f"layer_profile.rank{r}.json" for r in range(4)]
    optimizer_bytes: dict[int, int] = {}
    for path in files:
        record = json.loads(path.read_text())
        assert record["iteration"] == ITERS
        whole = record["layer_profile"]
        assert [p["layer"] for p in whole] == list(range(8))
        assert all(p["forward_s"] > 0 and p["backward_s"] > 0 and p["activation_bytes"] > 0 for p in whole)
        mine = [p["layer"] for p in record["layers"]]
        assert mine in ([0, 1, 2, 3], [4, 5, 6, 7])
        for p in record["layers"]:
            assert p["parameter_bytes"] == p["gradient_bytes"] > 0  # fp32; DDP keeps frozen layers' grad buffer
            optimizer_bytes[p["layer"]] = optimizer_bytes.get(p["layer"], 0) + p["optimizer_bytes"]
    # the two data-parallel shards of a layer hold Adam's two fp32 moments of all its parameters
    sizes = {p["layer"]: p["parameter_bytes"] for p in whole}
    assert all(optimizer_bytes[layer] >= 2 * sizes[layer] for layer in range(8)), (optimizer_bytes, sizes)


def _assert_frozen_layers_had_no_gradient(grads: dict[int, dict[int, dict]]) -> None:
    for rank, by_iteration in grads.items():
        assert sorted(by_iteration) == list(range(1, ITERS + 1))
        for iteration, layers in by_iteration.items():
            for layer, params in layers.items():
                frozen = layer in FROZEN and iteration >= FREEZE_AT
                for name, g in params.items():
                    assert g["requires_grad"] is not frozen, (rank, iteration, layer, name)
                    if frozen:
                        assert g["grad_is_none"] and g["main_grad_abs_sum"] == 0.0, (rank, iteration, layer, name)
                    else:
                        assert g["main_grad_abs_sum"] > 0.0, (rank, iteration, layer, name)


def test_under_overlapped_grad_reduce_frozen_layers_compute_gradients_but_never_change(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    sets = TINY + ["parallel.dp=2", "train.global_batch_size=4", "train.iters=3", "train.weight_decay=0.1"]
    sets += ["schedule.kind=1f1b", "schedule.num_slices=1", 'dynmo.freeze="2:0-3"']
    flags = megatron_args(sets) + ["--overlap-grad-reduce"]
    env = {"MEGATRON_SLIM_TEST_LAYER_WEIGHTS": "1"}
    run = run_pretrain(2, flags, tmp_path / "run", launcher=True, data_prefix=corpus, env=env)
    assert len(run.losses) == 3 and run.skipped == 0
    assert "frozen layers compute weight gradients, dropped before the optimizer (--overlap-grad-reduce)" in run.log
    weights = _weights(tmp_path / "run" / "records", 2)
    grads = _weights(tmp_path / "run" / "records", 2, "layer_grads")
    for rank in range(2):
        for layer in range(8):
            series = [weights[rank][i][layer] for i in (1, 2, 3)]
            if layer < 4:  # frozen from iteration 2: unchanged after step 1
                assert series[0] == series[1] == series[2], (rank, layer)
            else:
                assert series[0] != series[1] != series[2], (rank, layer)
            for g in grads[rank][3][layer].values():
                assert g["requires_grad"] and g["main_grad_abs_sum"] > 0.0, (rank, layer)
