"""The start-up rules are written once (``plan.startup.rules``): a rule that binds several callers
fires from each caller's own entry point -- the launcher on Megatron-LM's flags, ``train`` and
``megatron-args`` on a recipe -- with the same wording, each in its own input names."""

import argparse
from dataclasses import replace

import pytest

from megatron_slim.megatron.launch.args import settings_from_megatron_args
from megatron_slim.megatron.launch.flags import check_megatron_args, recipe_to_megatron_args
from megatron_slim.plan.recipe import load_recipe
from megatron_slim.plan.schema import ConfigError
from megatron_slim.plan.startup import INPUTS, LAUNCHER, MEGATRON_ARGS, RULES, TRAIN, Inputs, Settings, broken_rule
from megatron_slim.plan.startup.from_recipe import megatron_args_settings, train_settings
from megatron_slim.plan.startup.settings import NO_CP_ENGINE
from megatron_slim.train.checks import check_trainable
from tests.oracle.models import TINY_CP_MEGATRON_ARGS

FLAGS = TINY_CP_MEGATRON_ARGS
CP_RECIPE = ["parallel.pp=1", "parallel.cp=2", "schedule.kind=1f1b", "schedule.num_slices=1", "cp.engine=zeppelin"]
SLIMPIPE_FLAGS = dict(
    use_slimpipe=True,
    slimpipe_num_slices=2,
    cp_engine="te",
    context_parallel_size=1,
    reset_position_ids=False,
    reset_attention_mask=False,
)

# rule -> (flags that break it, {caller: recipe overrides that break it})
SHARED = {
    "remap-needs-zeppelin": (
        dict(cp_engine="ring", cp_remap=True),
        {TRAIN: CP_RECIPE + ["cp.engine=ring", "cp.remap=true"]},
    ),
    "one-pack-per-microbatch": (
        dict(micro_batch_size=2),
        {TRAIN: CP_RECIPE + ["train.micro_batch_size=2", "train.global_batch_size=4"]},
    ),
    "slice-policy-exchange": (
        {**SLIMPIPE_FLAGS, "slimpipe_slice_policy": "exchange", "slimpipe_vocab_parallel": True},
        {MEGATRON_ARGS: ["schedule.num_slices=2", "schedule.slice_policy=exchange", "schedule.vocab_parallel=true"]},
    ),
    "slice-policy-exchange-cp-engine": (
        {**SLIMPIPE_FLAGS, "slimpipe_slice_policy": "exchange", "context_parallel_size": 2, "cp_engine": "zeppelin"},
        {
            MEGATRON_ARGS: [
                "schedule.num_slices=2",
                "schedule.slice_policy=exchange",
                "parallel.cp=2",
                "cp.engine=zeppelin",
            ]
        },
    ),
    "vocab-parallel-megatron": (
        {**SLIMPIPE_FLAGS, "slimpipe_vocab_parallel": True, "tensor_model_parallel_size": 2},
        {MEGATRON_ARGS: ["schedule.num_slices=2", "schedule.vocab_parallel=true", "parallel.tp=2"]},
    ),
    "slimpipe-with-cp-engine": (
        {
            **SLIMPIPE_FLAGS,
            "cp_engine": "zeppelin",
            "context_parallel_size": 2,
            "pipeline_model_parallel_size": 2,
            "virtual_pipeline_model_parallel_size": 2,
        },
        {
            MEGATRON_ARGS: [
                "schedule.num_slices=2",
                "parallel.cp=2",
                "parallel.pp=2",
                "parallel.vpp=2",
                "cp.engine=zeppelin",
            ]
        },
    ),
    "slimpipe-recompute": (
        {**SLIMPIPE_FLAGS, "recompute_granularity": "full", "context_parallel_size": 2, "cp_engine": "zeppelin"},
        {
            MEGATRON_ARGS: [
                "schedule.num_slices=2",
                "train.recompute=full",
                "parallel.cp=2",
                "parallel.pp=1",
                "cp.engine=zeppelin",
            ]
        },
    ),
    "offload-needs-slimpipe": (
        dict(slimpipe_offload_ratio=0.5),
        {MEGATRON_ARGS: ["schedule.kind=1f1b", "schedule.num_slices=1", "train.offload_ratio=0.5"]},
    ),
    "offload-full-uniform": (
        {
            **SLIMPIPE_FLAGS,
            "slimpipe_offload_ratio": 0.5,
            "recompute_granularity": "full",
            "recompute_method": "uniform",
        },
        {
            caller: ["schedule.num_slices=2", "train.recompute=full", "train.offload_ratio=0.5"]
            for caller in (TRAIN, MEGATRON_ARGS)
        },
    ),
}
RECIPE_ENTRY = {
    TRAIN: (check_trainable, train_settings),
    MEGATRON_ARGS: (recipe_to_megatron_args, megatron_args_settings),
}
NEUTRAL = Inputs("neutral", {key: f"<{key}>" for key in {**INPUTS[LAUNCHER].names, **INPUTS[TRAIN].names}})


def _refusal(entry, value) -> str:
    with pytest.raises(ConfigError) as caught:
        entry(value)
    return str(caught.value)


def test_every_rule_two_callers_share_has_a_case_here():
    shared = {r.name for r in RULES if len(r.callers) > 1}
    assert shared == set(SHARED)
    for rule in RULES:
        assert set(rule.callers) <= {LAUNCHER, TRAIN, MEGATRON_ARGS}, rule.name


@pytest.mark.parametrize("name", sorted(SHARED))
def test_a_shared_rule_fires_from_every_caller_with_the_same_wording(name):
    rule = next(r for r in RULES if r.name == name)
    flags, recipes = SHARED[name]
    assert set(recipes) | {LAUNCHER} == set(rule.callers)
    args = argparse.Namespace(**{**FLAGS, **flags})
    launcher_settings = settings_from_megatron_args(args)
    assert broken_rule(launcher_settings, LAUNCHER) is rule
    launcher = _refusal(check_megatron_args, args)
    assert launcher == rule.message(launcher_settings, INPUTS[LAUNCHER])
    for caller, overrides in recipes.items():
        entry, view = RECIPE_ENTRY[caller]
        recipe = load_recipe("tiny-cpu", overrides)
        settings = view(recipe)
        assert broken_rule(settings, caller) is rule
        refused = _refusal(entry, recipe)
        assert refused == rule.message(settings, INPUTS[caller])
        # one wording: rendered with neutral names, both callers' refusals read the same
        assert rule.message(settings, NEUTRAL) == rule.message(launcher_settings, NEUTRAL)
        named = [key for key in NEUTRAL.names if f"<{key}>" in rule.message(settings, NEUTRAL)]
        assert named and all(INPUTS[caller].name(key) in refused for key in named)  # each in its own names
        assert all(INPUTS[LAUNCHER].name(key) in launcher for key in named)


def test_cp_engines_with_pipelines_run_in_train_and_through_the_megatron_launcher():
    for pp, layers in ((2, 2), (3, 3), (4, 4)):
        check_megatron_args(argparse.Namespace(**{**FLAGS, "pipeline_model_parallel_size": pp, "num_layers": layers}))
    for engine in ("zeppelin", "ring", "ulysses", "a2a+p2p", "allgather", "dynamic"):
        check_trainable(load_recipe("tiny-cpu", CP_RECIPE + ["parallel.pp=2", f"cp.engine={engine}"]))


@pytest.mark.parametrize("engine", ["zeppelin", "ring", "ulysses"])
def test_train_runs_slimpipe_slices_under_cp_with_the_sliced_engines(engine):
    sets = ["parallel.cp=2", "parallel.pp=2", "schedule.kind=slimpipe", "schedule.num_slices=2", f"cp.engine={engine}"]
    recipe = load_recipe("tiny-cpu", sets)
    check_trainable(recipe)
    settings = train_settings(recipe)
    assert settings.cp_engine == engine and settings.slimpipe and not recipe.query_out_cp
    refused = _refusal(lambda sets: load_recipe("tiny-cpu", sets), sets + ["cp.engine=zeppelin", "cp.remap=true"])
    assert "one of zeppelin, ring, ulysses (ring is the default) with cp.remap=false when schedule.kind=slimpipe" in (
        refused
    )


@pytest.mark.parametrize(
    "change,rule,words",
    [
        (
            dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
            "cp-engine-virtual-pipeline",
            "allowed: --virtual-pipeline-model-parallel-size 1",
        ),
        (
            dict(pipeline_model_parallel_size=2, recompute_granularity="full"),
            "cp-engine-pipeline-recompute",
            "allowed: no recomputation, or --pipeline-model-parallel-size 1",
        ),
    ],
)
def test_what_a_cp_engine_cannot_run_under_the_launchers_pipeline_is_refused(change, rule, words):
    args = argparse.Namespace(**{**FLAGS, **change})
    assert broken_rule(settings_from_megatron_args(args), LAUNCHER).name == rule
    refused = _refusal(check_megatron_args, args)
    assert refused.startswith("--cp-engine zeppelin") and words in refused, refused


@pytest.mark.parametrize("pp", [2, 3, 4])
@pytest.mark.parametrize("version", [(0, 16), (0, 17), (0, 18), (0, 19)])
def test_a_cp_engine_under_the_launchers_pipeline_runs_at_tp2_on_every_megatron_core(pp, version):
    """Every stage and TP rank plans from stage 0's TP rank 0 lengths (``share_first_stage_lengths``)."""
    change = dict(pipeline_model_parallel_size=pp, tensor_model_parallel_size=2, num_layers=2 * pp)
    args = argparse.Namespace(**{**FLAGS, **change})
    settings = replace(settings_from_megatron_args(args), megatron_core=version)
    assert (settings.pp, settings.tp, settings.cp_engine_runs) == (pp, 2, True)
    assert broken_rule(settings, LAUNCHER) is None
    assert "cp-engine-pipeline-tp" not in {rule.name for rule in RULES}


def test_train_refuses_slimpipe_slices_under_the_other_engines_naming_what_runs():
    refused = _refusal(
        lambda e: load_recipe("tiny-cpu", ["parallel.cp=2", "schedule.kind=slimpipe", f"cp.engine={e}"]), "allgather"
    )
    assert refused.startswith("cp.engine: invalid value (got 'allgather'; allowed: one of zeppelin, ring, ulysses")
    settings = Settings(cp=2, slimpipe=True, num_slices=2, cp_engine="allgather")
    rule = broken_rule(settings, TRAIN)
    assert rule is not None and rule.name == "train-slices-under-cp"
    message = rule.message(settings, INPUTS[TRAIN])
    assert message.startswith("cp.engine: SlimPipe slices under this engine are not checked")
    assert message.endswith(
        "allowed: one of zeppelin, ring, ulysses with schedule.num_slices > 1 (each window planned once, every "
        "slice's query-out attention following the plan and reading the K/V of the same documents' earlier "
        "slices), or schedule.num_slices=1 (schedule.kind=1f1b or interleaved), which runs cp.engine=allgather "
        "on one planned pack per microbatch)"
    )
    assert broken_rule(Settings(cp=2, slimpipe=True, num_slices=2, cp_engine="zeppelin"), TRAIN) is None


@pytest.mark.parametrize("method", ["slimpack", "megatron", "bfd"])
def test_train_runs_packed_slimpipe_slices_under_cp_without_an_engine(method):
    sets = ["parallel.cp=2", "parallel.pp=2", "schedule.num_slices=4", f"data.packing={method}"]
    recipe = load_recipe("tiny-cpu", sets)
    assert recipe.query_out_cp
    check_trainable(recipe)
    settings = train_settings(recipe)
    assert settings.cp_engine == NO_CP_ENGINE and not settings.cp_engine_runs and settings.slimpipe
    for kept in (["train.recompute=full"], ["train.recompute=selective"], ["train.offload_ratio=0.5"]):
        check_trainable(load_recipe("tiny-cpu", sets + kept))  # SlimPipe's query-out CP attention
    assert not load_recipe("tiny-cpu", sets[:3]).query_out_cp  # unpacked: the engine path
    refused = _refusal(check_trainable, load_recipe("tiny-cpu", sets[:3] + ["train.recompute=full"]))
    assert broken_rule(train_settings(load_recipe("tiny-cpu", sets[:3] + ["train.offload_ratio=0.5"])), TRAIN).name == (
        "cpu-recompute-cp"
    )
    assert refused == (
        "train.recompute=full, train.offload_ratio=0.0 with parallel.cp=2: the context-parallel attention "
        "(cp.engine=ring) is not checked under recomputation or offloading here; allowed with parallel.cp > 1: "
        "SlimPipe's own query-out CP attention (schedule.kind=slimpipe with schedule.num_slices > 1 and "
        "data.packing other than none, or schedule.slice_policy=exchange with cp.engine=ring), or "
        "train.recompute=none and train.offload_ratio=0"
    )


def test_recipe_field_names_and_flags_cover_the_same_settings():
    # eval_iters is checked only for the CPU loop
    assert set(INPUTS[TRAIN].names) == set(INPUTS[LAUNCHER].names) | {"eval_iters"}


@pytest.mark.parametrize("policy", ["uniform", "balanced"])
def test_the_launcher_and_recipes_accept_the_same_slice_counts(policy):
    """One slice-alignment rule (``plan.cost.slicing``): the launcher's flags and a recipe agree."""
    from megatron_slim.plan.startup import Settings

    for seq, n, cp in [(s, n, c) for s in (48, 64, 96) for n in (1, 2, 3, 4, 8, 32) for c in (1, 2)]:
        flags = Settings(cp=cp, slimpipe=True, num_slices=n, slice_policy=policy, seq_length=seq)
        launcher_accepts = broken_rule(flags, LAUNCHER) is None
        try:
            load_recipe(
                "tiny-cpu",
                [
                    f"model.seq_length={seq}",
                    f"schedule.num_slices={n}",
                    f"parallel.cp={cp}",
                    f"schedule.slice_policy={policy}",
                    "parallel.pp=1",
                ],
            )
            recipe_accepts = True
        except ConfigError:
            recipe_accepts = False
        assert launcher_accepts == recipe_accepts, (seq, n, cp, policy)


def test_cp_engine_and_packing_pipelines_are_not_refused_on_any_megatron_core():
    """pp2 x cp2 with a CP engine and pp4 packing run on every megatron-core (the last stage plans from
    the first stage's lengths where Megatron hands it no tokens)."""
    engine = Settings(cp=2, pp=2, cp_engine="zeppelin")
    packing = Settings(pp=4, slimpipe=True, num_slices=2, seq_length=64, packing="slimpack", per_token_loss=True)
    for version in ((0, 16), (0, 17), (0, 18), (0, 19), None):
        assert broken_rule(replace(engine, megatron_core=version), LAUNCHER) is None, version
        assert broken_rule(replace(packing, megatron_core=version), LAUNCHER) is None, version


def test_the_last_stage_reads_tokens_below_megatron_core_018_only():
    from megatron_slim.plan.startup.settings import last_stage_reads_tokens

    assert [last_stage_reads_tokens(v) for v in ((0, 16), (0, 17), (0, 18), (0, 19), (1, 0), None)] == [
        True,
        True,
        False,
        False,
        False,
        True,
    ]


@pytest.mark.parametrize("recompute", [dict(recompute_granularity="full"), dict(recompute_granularity="selective")])
def test_the_launcher_runs_slimpipe_recomputation_under_query_out_cp_and_refuses_it_on_engine_plans(recompute):
    query_out = {**FLAGS, **SLIMPIPE_FLAGS, **recompute, "context_parallel_size": 2, "pipeline_model_parallel_size": 2}
    assert broken_rule(settings_from_megatron_args(argparse.Namespace(**query_out)), LAUNCHER) is None
    refused = _refusal(check_megatron_args, argparse.Namespace(**{**query_out, "cp_engine": "ring"}))
    assert refused.endswith(
        "not on a CP engine's plans; allowed: drop --cp-engine, drop --recompute-granularity, "
        "--context-parallel-size 1, or Megatron's own schedule (no --use-slimpipe)"
    ), refused
    sets = [
        "parallel.pp=2",
        "parallel.cp=2",
        "schedule.num_slices=2",
        f"train.recompute={recompute['recompute_granularity']}",
    ]
    recipe_to_megatron_args(load_recipe("tiny-cpu", [*sets, "cp.engine=ring"]))  # SlimPipe's query-out CP
    assert "allowed: cp.engine=ring, train.recompute=none" in _refusal(
        recipe_to_megatron_args, load_recipe("tiny-cpu", [*sets, "cp.engine=zeppelin"])
    )
