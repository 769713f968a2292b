"""``--slimpipe-packing`` start-up rules (``plan/startup/rules_packing.py``): what the launcher's
packed windows cannot run is refused, naming the flag and what is allowed; and, under SlimPipe,
Megatron's own runtime packing scheduler (``rules_slimpipe.py``), not its THD batches of whole windows."""

from __future__ import annotations

from dataclasses import replace

import pytest

from megatron_slim.plan.schema import ConfigError
from megatron_slim.plan.startup import LAUNCHER, Settings, broken_rule, check

RUNS = Settings(pp=2, slimpipe=True, num_slices=2, seq_length=64, packing="slimpack", per_token_loss=True)


def test_a_packed_slimpipe_run_with_per_token_loss_passes_at_any_pipeline_size():
    check(RUNS, LAUNCHER)
    check(replace(RUNS, pp=1, dataloader_type="single"), LAUNCHER)
    for pp in (3, 4, 8):  # the first stage hands the documents to the middle stages
        check(replace(RUNS, pp=pp), LAUNCHER)


def test_a_packed_run_passes_under_tensor_and_context_parallelism():
    # TP rank 0 hands the documents to the other TP ranks; every CP rank reads the whole window
    for tp, cp, pp in ((2, 1, 2), (1, 2, 2), (2, 2, 1), (4, 2, 4)):
        assert broken_rule(replace(RUNS, tp=tp, cp=cp, pp=pp), LAUNCHER) is None, (tp, cp, pp)


@pytest.mark.parametrize(
    "change,rule,words",
    [
        (dict(slimpipe=False, num_slices=1), "packing-needs-slimpipe", "needs --use-slimpipe"),
        (dict(pp=4, vpp=2), "packing-pipeline", "without virtual stages"),
        (dict(vpp=2), "packing-pipeline", "--virtual-pipeline-model-parallel-size 1"),
        (dict(micro_batch_size=2), "packing-micro-batch", "allowed: --micro-batch-size 1"),
        (dict(per_token_loss=False), "packing-per-token-loss", "needs --calculate-per-token-loss"),
        (dict(dataloader_type="cyclic"), "packing-dataloader", "allowed: --dataloader-type single"),
        (dict(sequence_packing=True), "packing-megatron-schedulers", "drop --sequence-packing"),
        (dict(hybrid_cp=True), "packing-megatron-schedulers", "--hybrid-context-parallel"),
        (dict(packing="lpfhp"), "packing-method", "allowed: none, slimpack, megatron, bfd"),
    ],
)
def test_what_packed_windows_cannot_run_is_refused_at_start_up(change, rule, words):
    bad = replace(RUNS, **change)
    assert broken_rule(bad, LAUNCHER).name == rule
    with pytest.raises(ConfigError, match="--slimpipe-packing") as caught:
        check(bad, LAUNCHER)
    assert words in str(caught.value)


def test_without_packing_none_of_the_rules_binds():
    plain = replace(RUNS, packing="none", per_token_loss=False, pp=4, dataloader_type="cyclic")
    assert broken_rule(plain, LAUNCHER) is None or not broken_rule(plain, LAUNCHER).name.startswith("packing")


@pytest.mark.parametrize("flags", [dict(sequence_packing=True), dict(sequence_packing_scheduler="dp_balanced")])
def test_megatrons_runtime_packing_scheduler_is_refused_under_slimpipe(flags):
    """Megatron-LM's runtime packing (its dev branch) varies the microbatches' length and count."""
    import argparse

    from megatron_slim.megatron.launch.args import settings_from_megatron_args

    args = argparse.Namespace(use_slimpipe=True, slimpipe_num_slices=2, seq_length=64, **flags)
    found = broken_rule(settings_from_megatron_args(args), LAUNCHER)
    assert found is not None and found.name == "slimpipe-packing"
    with pytest.raises(ConfigError, match="drop it") as caught:
        check(settings_from_megatron_args(args), LAUNCHER)
    assert "--sft" in str(caught.value)


def test_megatrons_thd_batches_of_whole_windows_are_not_refused_under_slimpipe():
    """``--sft`` / ``--dataloader-inter-document-masking`` windows: their ``cu_seqlens`` are the
    window's documents (``runtime/pipeline/sliced_data.batch_documents``)."""
    import argparse

    from megatron_slim.megatron.launch.args import settings_from_megatron_args

    args = argparse.Namespace(use_slimpipe=True, slimpipe_num_slices=2, seq_length=64, sft=True)
    check(settings_from_megatron_args(args), LAUNCHER)
