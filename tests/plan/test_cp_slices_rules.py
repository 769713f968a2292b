"""Start-up rules of SlimPipe slices that follow a CP engine's plan through Megatron-LM's launcher
(rule ``slimpipe-with-cp-engine``): what runs, what is refused, and the flags ``megatron-args`` writes."""

from dataclasses import replace

import pytest

from megatron_slim.megatron.launch.flags import recipe_to_megatron_args
from megatron_slim.plan.recipe import load_recipe
from megatron_slim.plan.startup import INPUTS, LAUNCHER, RULES, broken_rule
from megatron_slim.plan.startup.settings import Settings

RUNS = Settings(
    cp=2,
    pp=2,
    cp_engine="zeppelin",
    slimpipe=True,
    num_slices=2,
    seq_length=64,
    reset_position_ids=True,
    reset_attention_mask=True,
    position_embedding="rope",
    megatron_core=(0, 16),
)


@pytest.mark.parametrize("engine", ["zeppelin", "ring", "ulysses"])
@pytest.mark.parametrize("pp", [1, 2])
def test_the_launcher_runs_slices_under_a_sliced_engine(engine, pp):
    assert broken_rule(replace(RUNS, cp_engine=engine, pp=pp), LAUNCHER) is None


@pytest.mark.parametrize(
    "change",
    [
        dict(pp=4),  # middle stages read no batch
        dict(pp=2, megatron_core=(0, 19)),  # the last stage's get_batch keeps no tokens
        dict(pp=3, megatron_core=(0, 18)),
        dict(tp=2),  # TP ranks other than 0 read no batch
        dict(tp=2, pp=4, megatron_core=(0, 19)),
    ],
)
def test_stages_and_tp_ranks_without_batches_take_the_first_stages_lengths(change):
    assert broken_rule(replace(RUNS, **change), LAUNCHER) is None


@pytest.mark.parametrize(
    "change, shown",
    [
        (dict(cp_engine="allgather"), "--cp-engine allgather with --use-slimpipe"),
        (
            dict(cp_remap=True),
            "--tensor-model-parallel-size 1, --virtual-pipeline-model-parallel-size 1, --cp-remap:",
        ),
        (dict(tp=2, sequence_parallel=True), "--tensor-model-parallel-size 2, "),
        (dict(vpp=2), "--virtual-pipeline-model-parallel-size 2"),
        (dict(packing="slimpack"), "--slimpipe-packing slimpack"),
    ],
)
def test_the_launcher_refuses_what_slices_under_an_engine_do_not_run(change, shown):
    settings = replace(RUNS, **change)
    rule = next(r for r in RULES if r.name == "slimpipe-with-cp-engine")
    assert rule.broken(settings) and not rule.broken(RUNS)
    message = rule.message(settings, INPUTS[LAUNCHER])
    assert shown in message
    assert "--cp-engine zeppelin | ring | ulysses with --virtual-pipeline-model-parallel-size=1, no " in message
    assert "no --sequence-parallel when --tensor-model-parallel-size > 1" in message
    assert message.endswith(
        "allowed: those, or drop --cp-engine (SlimPipe's own zigzag query-out CP), or no --use-slimpipe"
    )


def test_the_document_flags_go_together_and_the_mask_is_allowed_under_an_engine():
    rule = broken_rule(replace(RUNS, reset_attention_mask=False), LAUNCHER)
    assert rule is not None and rule.name == "slimpipe-cp-engine-documents"
    assert broken_rule(replace(RUNS, reset_attention_mask=False, reset_position_ids=False), LAUNCHER) is None
    no_engine = replace(RUNS, cp_engine="te")
    assert broken_rule(no_engine, LAUNCHER).name == "slimpipe-document-masks"  # SlimPipe's own CP: refused


@pytest.mark.parametrize("engine, flagged", [("zeppelin", True), ("ulysses", True), ("ring", False)])
def test_megatron_args_hands_the_engine_to_slimpipe_except_ring(engine, flagged):
    sets = ["parallel.pp=2", "parallel.cp=2", "schedule.kind=slimpipe", "schedule.num_slices=2", f"cp.engine={engine}"]
    flags = [str(f) for f in recipe_to_megatron_args(load_recipe("tiny-cpu", sets))]
    assert ("--cp-engine" in flags) == flagged
    if flagged:
        at = flags.index("--cp-engine")
        assert flags[at : at + 4] == ["--cp-engine", engine, "--reset-position-ids", "--reset-attention-mask"]
        assert flags.count("--slimpipe-hardware") == 1 and "--use-slimpipe" in flags
