"""Where ``schedule.vocab_parallel`` / ``--slimpipe-vocab-parallel`` runs: the start-up rules
``vocab-parallel-megatron`` (the launcher and ``megatron-args``) and ``vocab-parallel-train``."""

import argparse

from megatron_slim.megatron.launch.args import settings_from_megatron_args
from megatron_slim.megatron.launch.flags import check_megatron_args, recipe_to_megatron_args
from megatron_slim.plan.recipe import load_recipe
from megatron_slim.plan.startup import LAUNCHER, RULES, TRAIN, Settings, broken_rule
from megatron_slim.train.checks import check_trainable
from tests.plan.test_startup_rules import CP_RECIPE, FLAGS, SLIMPIPE_FLAGS, _refusal


def test_vocab_parallel_runs_under_the_megatron_launcher_with_slimpipe_alone():
    from megatron_slim.megatron.launch.flags import add_arguments

    parsed = add_arguments(argparse.ArgumentParser()).parse_args(["--slimpipe-vocab-parallel"])
    assert parsed.slimpipe_vocab_parallel is True
    vocab = {**FLAGS, **SLIMPIPE_FLAGS, "slimpipe_vocab_parallel": True}
    check_megatron_args(argparse.Namespace(**vocab))  # SlimPipe, tp=1, cp=1, vpp=1, fp32: it runs
    interleaved_flags = {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}
    check_megatron_args(argparse.Namespace(**{**vocab, **interleaved_flags}))  # several chunks per rank
    refused = _refusal(check_megatron_args, argparse.Namespace(**{**vocab, "bf16": True}))
    assert refused == (
        "--slimpipe-vocab-parallel with --tensor-model-parallel-size 1, --context-parallel-size 1, "
        "bf16 parameters, --slimpipe-packing none: under Megatron-LM's launcher the vocabulary exchange runs "
        "in the SlimPipe schedule (any number of model chunks per pipeline rank), on fp32 parameters, without "
        "tensor or context parallelism (megatron-slim train runs more); "
        "allowed: --use-slimpipe, --tensor-model-parallel-size 1, --context-parallel-size 1, "
        "drop --bf16 or --fp16, --slimpipe-packing none, or drop --slimpipe-vocab-parallel"
    )
    for bad in (
        {"tensor_model_parallel_size": 2},
        {"context_parallel_size": 2},
        {"slimpipe_packing": "slimpack"},
        {"use_slimpipe": False},
    ):
        settings = settings_from_megatron_args(argparse.Namespace(**{**vocab, **bad}))
        assert "vocab-parallel-megatron" in [r.name for r in RULES if LAUNCHER in r.callers and r.broken(settings)]
    recipe = load_recipe("tiny-cpu", ["parallel.pp=2", "schedule.num_slices=2", "schedule.vocab_parallel=true"])
    check_trainable(recipe)  # megatron-slim train runs it
    assert "--slimpipe-vocab-parallel" in recipe_to_megatron_args(recipe)
    interleaved = ["parallel.pp=2", "parallel.vpp=2", "schedule.vocab_parallel=true"]
    sliced = load_recipe("tiny-cpu", [*interleaved, "schedule.kind=slimpipe", "schedule.num_slices=2"])
    assert "--num-layers-per-virtual-pipeline-stage" in recipe_to_megatron_args(sliced)
    megatrons = load_recipe("tiny-cpu", [*interleaved, "schedule.kind=interleaved", "schedule.num_slices=1"])
    assert "allowed: schedule.kind=slimpipe, parallel.tp=1, parallel.cp=1, train.precision=fp32, " in (
        _refusal(recipe_to_megatron_args, megatrons)
    )
    flags = recipe_to_megatron_args(load_recipe("tiny-cpu", ["schedule.num_slices=2"]))
    assert "--slimpipe-vocab-parallel" not in flags


def test_train_refuses_vocab_parallel_where_the_exchange_does_not_run():
    vocab = ["parallel.pp=2", "schedule.vocab_parallel=true"]
    check_trainable(load_recipe("tiny-cpu", [*vocab, "schedule.num_slices=2", "parallel.tp=2"]))  # TP shards
    refused = _refusal(check_trainable, load_recipe("tiny-cpu", [*CP_RECIPE, *vocab, "parallel.tp=2"]))
    assert refused == (
        "schedule.vocab_parallel=true with parallel.tp=2, parallel.cp=2, parallel.vpp=1, "
        "parallel.sequence_parallel=false: the pipeline's vocabulary exchange runs with context parallelism only "
        "under a CP engine, with one model chunk per rank and without tensor parallelism, and with tensor "
        "parallelism on one model chunk per rank and whole (not sequence-parallel) hidden states; allowed: "
        "parallel.cp=1, or parallel.vpp=1 and parallel.tp=1; with parallel.tp > 1 parallel.vpp=1 and "
        "parallel.sequence_parallel=false; or schedule.vocab_parallel=false"
    )
    # tp > 1 with several chunks per rank has no exactness test; sequence-parallel hidden states are
    # sequence shards, which the exchange does not gather (train refuses them on CPU anyway: GPU ranks)
    for untested in (
        Settings(pp=2, tp=2, vpp=2, vocab_parallel=True),
        Settings(pp=2, tp=2, sequence_parallel=True, vocab_parallel=True),
    ):
        assert "vocab-parallel-train" in [r.name for r in RULES if TRAIN in r.callers and r.broken(untested)]
    assert broken_rule(Settings(pp=2, tp=2, vocab_parallel=True), TRAIN) is None
    check_trainable(load_recipe("tiny-cpu", [*vocab, "schedule.num_slices=2", "parallel.vpp=2"]))  # interleaved
    check_trainable(load_recipe("tiny-cpu", [*CP_RECIPE, *vocab]))  # under a CP engine
    recipe = load_recipe("tiny-cpu", [*CP_RECIPE, *vocab, "schedule.kind=interleaved", "parallel.vpp=2"])
    assert "vocab_parallel=true with parallel.tp=1, parallel.cp=2, parallel.vpp=2" in _refusal(check_trainable, recipe)
    rule = broken_rule(Settings(pp=2, cp=2, vocab_parallel=True), TRAIN)  # context parallelism without an engine
    assert rule is not None and rule.name == "vocab-parallel-train"
