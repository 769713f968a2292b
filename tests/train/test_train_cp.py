"""`megatron-slim train` with a context-parallel engine (``parallel.cp > 1``, ``cp.engine``).

* One training step of the job's CP plumbing (``train.cp``: documents between ``eod`` tokens, a plan
  per microbatch, the schedule adapter, ``cp_loss_func``, gradients averaged over data x context
  parallel ranks) equals the single-process reference: the whole model, every document run on its
  own with positions from 0, loss = mean over microbatches of each pack's masked-token mean --
  in the loss and in EVERY parameter gradient (zeppelin with and without remap, and ring).
* The CLI trains with zeppelin (cp=2, remap) and with ring (cp=2 x dp=2, 4 ranks): the loss falls,
  both runs give the same losses (CP is exact and gradients are averaged over data x context
  parallel ranks, so neither the engine nor the dp x cp split changes them), and the JSON /
  progress lines name the engine and each iteration's plans.

Topology: the tests write a CPU hardware profile with ``gpus_per_node: 1`` (2 CP ranks = 2 nodes x
1, so Zeppelin chooses between local and inter-node sequences and remaps across the NIC); there is
no topology key in a recipe, ``--set hardware=<profile YAML>`` selects it.
"""

import json

import pytest
import torch
import torch.distributed as dist

from megatron_slim.cli import main
from megatron_slim.runtime.spawn import run_ranks
from tests.oracle import reference
from tests.oracle.models import TINY_GQA_2L_LONG
from tests.overrides import once_per_key
from tests.train.conftest import HARDWARE

TOL = dict(atol=2e-5, rtol=1e-4)
MODEL = dict(TINY_GQA_2L_LONG, seq_length=128)
EOD = 1
# two microbatch windows; the first ends inside a document (no eod), the second is one long
# document followed by short ones (Zeppelin splits the long one across nodes, keeps short ones local)
WINDOWS = [(7, 45, 20, 56), (100, 9, 13, 6)]
ALL_WINDOWS = len(WINDOWS)


@pytest.fixture(scope="module")
def slow_nic_hardware(tmp_path_factory):
    """A NIC so slow that Zeppelin keeps even a whole-window document on one node (rank)."""
    path = tmp_path_factory.mktemp("hw") / "cpu-2-nodes-slow-nic.yaml"
    path.write_text(
        HARDWARE.replace("nic_bandwidth: 5.0e9", "nic_bandwidth: 1.5e7").replace(
            "nic_latency: 2.0e-6", "nic_latency: 1.0e-4"
        )
    )
    return str(path)


def _window(lengths, seed):
    """Tokens with an eod closing every document but the last, random labels, a ~85% loss mask."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    tokens = torch.randint(EOD + 1, MODEL["vocab_size"], (total,), generator=g)
    end = 0
    for s in lengths[:-1]:
        end += s
        tokens[end - 1] = EOD
    return {
        "tokens": tokens.unsqueeze(0),
        "labels": torch.randint(0, MODEL["vocab_size"], (1, total), generator=g),
        "loss_mask": (torch.rand(1, total, generator=g) > 0.15).float(),
        "position_ids": torch.arange(total).unsqueeze(0),
    }


def _recipe(engine, remap, cp, hardware_path, windows=ALL_WINDOWS):
    from megatron_slim.plan.recipe import recipe_from_dict

    return recipe_from_dict(
        {
            "name": "cp-step",
            "hardware": hardware_path,
            "model": MODEL,
            "parallel": {"cp": cp},
            "cp": {"engine": engine, "remap": remap},
            "train": {"global_batch_size": windows, "precision": "fp32"},
        }
    )


def _reference(model_cfg, solo, windows, seed):
    """Each window's documents (cut at ``eod``) through the unsharded model one at a time."""
    from megatron_slim.megatron.cp.lengths import document_lengths

    packs = [
        {
            "tokens": w["tokens"][0],
            "labels": w["labels"][0],
            "loss_mask": w["loss_mask"][0],
            "lengths": document_lengths(w["tokens"], EOD),
        }
        for w in windows
    ]
    return reference.per_document_step(model_cfg, solo, packs, seed)


def one_step(rank, world_size, cases, hardware_path, seed=1234, window_lengths=tuple(WINDOWS)):
    """Per case ``(engine, remap)``: one forward-backward of the training job's CP plumbing through
    the schedule adapter, gradients averaged as the loop does; on rank 0 also the reference."""
    from megatron_slim.megatron.model.gpt import build_rank_chunks, global_grads
    from megatron_slim.megatron.model.parallel import init_model_parallel
    from megatron_slim.megatron.slimpipe.schedule import SlimPipeSettings, make_forward_backward_func
    from megatron_slim.train.cp import CPTrainStep, cp_layer_classes
    from megatron_slim.train.step import average_data_parallel

    groups = init_model_parallel(cp=world_size)
    solo = reference.solo_groups(rank, world_size)
    windows = [_window(lengths, seed + k) for k, lengths in enumerate(window_lengths)]
    results = {}
    for engine, remap in cases:
        recipe = _recipe(engine, remap, world_size, hardware_path, len(windows))
        chunks = build_rank_chunks(recipe.model, groups, **cp_layer_classes(recipe), seed=seed)
        step = CPTrainStep(recipe, groups, EOD)
        step.attach(chunks)
        fb = make_forward_backward_func(SlimPipeSettings((MODEL["seq_length"],), kind="1f1b"))
        batches = step.plan_iteration(windows)
        reports = fb(
            forward_step_func=step.forward_step,
            data_iterator=[iter(batches)],
            model=chunks,
            num_microbatches=len(windows),
            seq_length=MODEL["seq_length"],
            micro_batch_size=1,
        )
        params = [p for c in chunks for p in c.parameters()]
        average_data_parallel(params, groups.dp_cp, world_size)
        pair = torch.stack([r["lm loss"] for r in reports]).sum(0)
        dist.all_reduce(pair, group=groups.cp)
        results[engine, remap] = {
            "grads": global_grads(chunks[0]) if rank == 0 else None,
            "summary": step.summary(),
            "pair": pair,
        }
    if rank == 0:
        results["reference"] = _reference(recipe.model, solo, windows, seed)
    return results


def test_one_cp_training_step_matches_the_per_document_reference(hardware):
    cases = [("zeppelin", True), ("zeppelin", False), ("ring", False)]
    results = run_ranks(one_step, 2, cases, hardware, timeout_s=300)
    ref_loss, ref_grads = results[0]["reference"]
    zeppelin = results[0]["zeppelin", True]["summary"]
    assert zeppelin["local"] > 0 and zeppelin["inter"] > 0 and zeppelin["remapped_tokens"] > 0
    assert zeppelin["padded"] == 0 and zeppelin["sequences"] == sum(len(w) for w in WINDOWS)
    for case in cases:
        got = results[0][case]
        assert got["grads"].keys() == ref_grads.keys()
        for name, want in ref_grads.items():
            where = f"{case} {name}"
            torch.testing.assert_close(got["grads"][name], want, **TOL, msg=lambda m, where=where: f"{where}: {m}")
        for rank in (0, 1):  # the summed [loss, tokens] reports give the token-weighted mean loss
            pair = results[rank][case]["pair"]
            torch.testing.assert_close(pair[0] / pair[1], ref_loss, **TOL)


def _train(tmp_path, name, data_cache, corpus, *sets):
    out = tmp_path / f"{name}.json"
    argv = [
        "train",
        "--set",
        *once_per_key(
            f"data.cache_dir={data_cache}",
            f"data.corpus={corpus}",
            "model.vocab_size=512",
            "parallel.pp=1",
            "schedule.kind=1f1b",
            "schedule.num_slices=1",
            "model.seq_length=256",
            "model.num_layers=2",
            "model.hidden_size=64",
            "model.ffn_hidden_size=160",
            "model.num_attention_heads=4",
            "model.num_query_groups=2",
            "train.global_batch_size=4",
            "train.iters=4",
            "train.warmup_iters=1",
            "train.lr=3e-3",
            *sets,
        ),
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    return json.loads(out.read_text())


# slow tier: the README's cp2 zeppelin train line (tests/test_readme_commands.py) and the pp2 x cp2
# CLI runs (test_train_cp_pipeline.py, test_train_cp_slices.py) run train's CP engines by default
@pytest.mark.slow
@pytest.mark.multi
def test_cli_trains_with_zeppelin_and_ring_with_falling_equal_losses(
    tmp_path, data_cache, short_documents, hardware, capfd
):
    zeppelin = _train(
        tmp_path,
        "zeppelin",
        data_cache,
        short_documents,
        "parallel.cp=2",
        "cp.engine=zeppelin",
        "cp.remap=true",
        f"hardware={hardware}",
    )
    printed = capfd.readouterr().out  # the ranks print the progress lines
    ring = _train(
        tmp_path,
        "ring",
        data_cache,
        short_documents,
        "parallel.cp=2",
        "parallel.dp=2",
        "cp.engine=ring",
        f"hardware={hardware}",
    )
    for run in (zeppelin, ring):
        assert len(run["losses"]) == 4 and run["losses"][-1] < run["losses"][0]
    assert zeppelin["losses"] == pytest.approx(ring["losses"], abs=2e-4)
    cp = zeppelin["cp"]
    assert (cp["engine"], cp["remap"], cp["size"], cp["nodes"], cp["document_masking"]) == (
        "zeppelin",
        True,
        2,
        2,
        True,
    )
    assert cp["attention"] == "engine" and len(cp["iterations"]) == 4 and all(i["packs"] == 4 for i in cp["iterations"])
    assert sum(i["local"] for i in cp["iterations"]) > 0 and sum(i["inter"] for i in cp["iterations"]) > 0
    assert ring["cp"]["engine"] == "ring" and all(i["local"] == 0 for i in ring["cp"]["iterations"])
    assert [i["packs"] for i in ring["cp"]["iterations"]] == [4] * 4  # summed over both data-parallel ranks
    assert "engine zeppelin with remap on 2 node(s)" in printed and "attention stays inside each document" in printed
    assert "| cp zeppelin: " in printed and " local/" in printed


@pytest.mark.parametrize(
    "sets, needle",
    [
        (
            ["parallel.cp=2", "schedule.kind=slimpipe", "schedule.num_slices=2", "cp.engine=allgather"],
            "cp.engine: invalid value (got 'allgather'",
        ),
        (["parallel.cp=2", "cp.engine=ring", "cp.remap=true"], "cp.remap"),
        (["parallel.cp=2", "train.micro_batch_size=2", "train.global_batch_size=4"], "train.micro_batch_size"),
        (["parallel.cp=2", "data.packing=slimpack"], "1 with data.packing=slimpack and schedule.kind=1f1b (or"),
    ],
)
def test_unsupported_cp_training_is_rejected_before_any_work(sets, needle, capsys):
    assert (
        main(["train", "--set", *once_per_key("parallel.pp=1", "schedule.kind=1f1b", "schedule.num_slices=1", *sets)])
        == 2
    )
    assert needle in capsys.readouterr().err


# every document one token long (ring, allgather and a2a+p2p put them all on CP rank 0), then one
# 128-token document (Zeppelin keeps it local over a slow NIC: rank 1 is empty)
EMPTY_RANK_WINDOWS = ((1,) * MODEL["seq_length"], (MODEL["seq_length"],))


def test_windows_that_leave_a_cp_rank_without_tokens_train_exactly_under_every_engine(slow_nic_hardware):
    """Such windows used to stop the run ("every plan leaves a CP rank without tokens"); now the empty
    rank runs one masked padding row and the step equals the per-document reference."""
    cases = [("ring", False), ("allgather", False), ("a2a+p2p", False), ("zeppelin", True)]
    results = run_ranks(one_step, 2, cases, slow_nic_hardware, 1234, EMPTY_RANK_WINDOWS, timeout_s=300)
    ref_loss, ref_grads = results[0]["reference"]
    for case in cases:  # ring, allgather, a2a+p2p: the one-token window; zeppelin: the one-document one
        got = results[0][case]
        assert got["summary"]["padded"] == 1 and got["summary"]["min_tokens_per_rank"] == 0, case
        for name, want in ref_grads.items():
            where = f"{case} {name}"
            torch.testing.assert_close(got["grads"][name], want, **TOL, msg=lambda m, where=where: f"{where}: {m}")
        for rank in (0, 1):
            pair = results[rank][case]["pair"]
            torch.testing.assert_close(pair[0] / pair[1], ref_loss, **TOL)
