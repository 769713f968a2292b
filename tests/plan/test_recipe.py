import dataclasses

import pytest

from megatron_slim.plan.recipe import available_recipes, load_recipe
from megatron_slim.plan.schema import ConfigError

REQUIRED = {"tiny-cpu", "llama2-7b-64k", "llama2-13b-128k", "llama3-8b-256k", "llama2-70b-512k"}


def test_shipped_recipes_load_and_are_frozen():
    assert set(available_recipes()) >= REQUIRED
    for name in available_recipes():
        r = load_recipe(name)
        assert r.name == name
        with pytest.raises(dataclasses.FrozenInstanceError, match="cannot assign to field 'pp'"):
            r.parallel.pp = 3
    llama70b = load_recipe("llama2-70b-512k").model
    assert llama70b.num_query_groups < llama70b.num_attention_heads
    lengths = {load_recipe(n).model.seq_length for n in REQUIRED - {"tiny-cpu"}}
    assert min(lengths) == 65536 and max(lengths) == 524288


def test_overrides_apply_with_types():
    r = load_recipe(
        "llama2-70b-512k",
        [
            "parallel.pp=4",
            "schedule.num_slices=16",
            "train.lr=1e-4",
            "parallel.sequence_parallel=false",
            "schedule.slice_policy=uniform",
        ],
    )
    assert (r.parallel.pp, r.schedule.num_slices, r.train.lr, r.parallel.sequence_parallel) == (4, 16, 1e-4, False)


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (
            ["parallel.pp=7"],
            "parallel.pp: invalid value (got 7; allowed: values with pp*vpp dividing model.num_layers=80",
        ),
        (["parallel.tp=3"], "parallel.tp: invalid value (got 3; allowed: a divisor of model.num_attention_heads=64)"),
        (["parallel.tp=16"], "parallel.tp: invalid value (got 16; allowed: a divisor of model.num_query_groups=8)"),
        (
            ["schedule.slice_policy=uniform", "schedule.num_slices=6"],
            "schedule.num_slices: invalid value (got 6; allowed: a count whose slices divide model.seq_length=524288",
        ),
        (
            ["parallel.bogus=1"],
            "--set parallel.bogus: unknown key (allowed: tp, pp, vpp, cp, dp, sequence_parallel, layers_per_stage)",
        ),
        (["model.hidden_size=big"], "model.hidden_size: invalid value (got 'big'; allowed: an integer)"),
        (["schedule.kind=zb"], "schedule.kind: invalid value (got 'zb'; allowed: '1f1b' | 'interleaved' | 'slimpipe')"),
        (["schedule.kind=1f1b"], "parallel.vpp: invalid value (got 5; allowed: 1 with schedule.kind=1f1b"),
        (["hardware=tpu"], "hardware: unknown profile 'tpu' (allowed: a800, cpu, h100, h800"),
        (
            ["parallel.dp=2", "train.global_batch_size=7"],
            "train.global_batch_size: invalid value (got 7; allowed: a multiple of "
            "train.micro_batch_size*parallel.dp=2)",
        ),
        (["parallel.cp=3"], "model.seq_length: invalid value (got 524288; allowed: a multiple of 2*parallel.cp=6"),
        (["parallel.pp"], "--set 'parallel.pp': expected KEY=VALUE"),
        (["parallel.pp.x=1"], "--set parallel.pp.x: parallel.pp is a value, not a section"),
    ],
)
def test_bad_overrides_fail_naming_field_value_and_allowed(overrides, needle):
    with pytest.raises(ConfigError) as err:
        load_recipe("llama2-70b-512k", overrides)
    assert needle in str(err.value)


def test_unknown_and_missing_yaml_keys(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {num_layers: 2}\ntrain: {global_batch_size: 1}\nextra: 1\n")
    with pytest.raises(ConfigError, match="extra: unknown key"):
        load_recipe(str(bad))
    bad.write_text("model: {num_layers: 2}\ntrain: {global_batch_size: 1}\n")
    with pytest.raises(ConfigError, match="model.hidden_size: required key is missing"):
        load_recipe(str(bad))
    with pytest.raises(ConfigError, match="does not exist"):
        load_recipe(str(tmp_path / "nope.yaml"))


@pytest.mark.parametrize(
    "sets,note",
    [
        (
            ["parallel.pp=8"],
            "note: --set parallel.pp=8 changes the job from 64 to 128 GPUs (tp4 pp8 cp1 dp4); "
            "parallel.dp=2 would keep 64",
        ),
        (["parallel.tp=8", "parallel.dp=2"], None),  # 8*4*1*2 = 64
        (
            ["parallel.dp=2", "train.global_batch_size=32"],
            "note: --set parallel.dp=2 changes the job from 64 to 32 GPUs (tp4 pp4 cp1 dp2)",
        ),
        (["schedule.num_slices=16"], None),
        ([], None),
    ],
)
def test_world_size_note_says_when_overrides_change_the_gpu_count(sets, note):
    from megatron_slim.plan.recipe_note import world_size_note

    recipe = load_recipe("llama2-7b-64k", sets)
    assert world_size_note("llama2-7b-64k", sets, recipe) == note


def test_world_size_note_names_the_unit_and_a_recipe_file(tmp_path):
    from megatron_slim.plan.recipe_note import world_size_note

    path = tmp_path / "r.yaml"
    path.write_text(
        "model: {num_layers: 4, hidden_size: 64, ffn_hidden_size: 128, num_attention_heads: 4, "
        "num_query_groups: 4, vocab_size: 256, seq_length: 64}\ntrain: {global_batch_size: 4}\n"
        "hardware: cpu\n"
    )
    recipe = load_recipe(str(path), ["parallel.pp=2"])
    assert (
        world_size_note(str(path), ["parallel.pp=2"], recipe, unit="ranks")
        == "note: --set parallel.pp=2 changes the job from 1 to 2 ranks (tp1 pp2 cp1 dp1)"
    )
