"""The rebalancing trigger's decision (pure): from a measured profile it proposes the exact min-max
split with the stage terms the planner expects, predicts step times, and moves only when the gain
over the interval pays for the migration; the recipe fields and flags are checked by name."""

import argparse
import itertools

import pytest

from megatron_slim.commands.train_dynmo import add_dynmo_args, dynmo_overrides
from megatron_slim.plan.dynmo.partition import Partition
from megatron_slim.plan.dynmo.profile import LayerProfile
from megatron_slim.plan.dynmo.trigger import StageModel, decide, migration_estimate_s, stage_loads, stage_model
from megatron_slim.plan.recipe import load_recipe
from megatron_slim.plan.schema import ConfigError

ON = ["dynmo.profile=true", "dynmo.rebalance=dynmo"]
MODEL = StageModel(
    first_layers=0.5,
    last_layers=1.0,
    first_bytes=0.0,
    last_bytes=0.0,
    in_flight=(2, 1),
    units_per_microbatch=1,
    num_microbatches=4,
    memory_cap=1e12,
    link_bandwidth=1e9,
)


def _frozen_prefix_profile(num_layers=8, frozen=4):
    """Layers below ``frozen`` backward only to their input: cheaper, and no gradient bytes."""
    return [
        LayerProfile(i, 0.010, 0.012 if i < frozen else 0.020, 1000, 0 if i < frozen else 1000, 2000, 1e5)
        for i in range(num_layers)
    ]


def _stage_times_by_hand(profile, split, model):
    """Each stage's time summed directly, with the fixed terms as multiples of the slowest layer."""
    slowest = max(p.forward_s + p.backward_s for p in profile)
    times, start = [], 0
    for s, n in enumerate(split):
        t = sum(p.forward_s + p.backward_s for p in profile[start : start + n])
        t += model.first_layers * slowest if s == 0 else 0.0
        t += model.last_layers * slowest if s == len(split) - 1 else 0.0
        times.append(t)
        start += n
    return times


def test_a_frozen_first_half_moves_layers_to_the_first_stage():
    profile = _frozen_prefix_profile()
    d = decide(7, "dynmo", profile, Partition((4, 4)), MODEL, steps_until_next=10)
    splits = [(a, 8 - a) for a in range(1, 8)]
    best = min(max(_stage_times_by_hand(profile, s, MODEL)) for s in splits)
    assert max(_stage_times_by_hand(profile, d.proposed, MODEL)) == pytest.approx(best, rel=1e-12)
    assert d.proposed[0] > 4 and d.move and d.before == (4, 4) and d.iteration == 7
    assert d.moved_layers == d.proposed[0] - 4
    for predicted, split in ((d.step_before_s, (4, 4)), (d.step_after_s, d.proposed)):
        times = _stage_times_by_hand(profile, split, MODEL)
        assert predicted == pytest.approx(sum(times) + 3 * max(times), rel=1e-12)
    moved = range(4, 4 + d.moved_layers)
    assert d.moved_bytes == sum(profile[i].static_bytes for i in moved)
    assert d.migration_s == pytest.approx(d.moved_bytes / MODEL.link_bandwidth, rel=1e-12)


def test_no_move_when_the_gain_does_not_pay_for_the_migration():
    profile = _frozen_prefix_profile()
    d = decide(7, "dynmo", profile, Partition((4, 4)), MODEL, steps_until_next=10)
    gain = d.step_before_s - d.step_after_s
    # a measured move of these bytes that took just more than the gain over 10 steps
    slow = (d.moved_bytes, gain * 10 * 1.01)
    assert not decide(7, "dynmo", profile, Partition((4, 4)), MODEL, 10, measured=slow).move
    assert decide(7, "dynmo", profile, Partition((4, 4)), MODEL, 10, measured=(d.moved_bytes, gain * 9)).move
    assert migration_estimate_s(300.0, 1e9, measured=(100.0, 2.0)) == pytest.approx(6.0)


def test_static_never_moves_and_diffusion_moves_toward_the_cheap_stage():
    profile = _frozen_prefix_profile()
    assert not decide(5, "static", profile, Partition((4, 4)), MODEL, 10).move
    d = decide(5, "diffusion", profile, Partition((4, 4)), MODEL, 10)
    assert d.proposed[0] > 4 and d.move


def test_a_memory_cap_holds_the_split():
    profile = _frozen_prefix_profile()
    capped = StageModel(**{**MODEL.__dict__, "memory_cap": 4 * 4000 + 2 * 4 * 1e5})  # stage 0: 4 layers at most
    d = decide(5, "dynmo", profile, Partition((4, 4)), capped, 10)
    assert d.proposed == (4, 4) and not d.move


def test_the_recipe_stage_model_prices_the_fixed_terms_and_the_cap():
    recipe = load_recipe("tiny-cpu", ["parallel.pp=2", *ON])
    m = stage_model(recipe)
    assert m.last_layers > m.first_layers > 0  # output layer + loss outweigh the embedding lookup
    assert m.memory_cap == recipe.hardware_profile.usable_hbm_bytes
    assert len(m.in_flight) == 2 and m.units_per_microbatch == 4 and m.num_microbatches == 8
    assert stage_model(load_recipe("tiny-cpu", ["parallel.pp=2", *ON, "dynmo.memory_cap_bytes=5e8"])).memory_cap == 5e8
    loads = stage_loads(_frozen_prefix_profile(), m)
    assert loads.extras.last_s == pytest.approx(m.last_layers * 0.030, rel=1e-12)
    assert loads.layers[0].activation_bytes == pytest.approx(1e5 / 4)


@pytest.mark.parametrize(
    "sets, needle",
    [
        (["dynmo.rebalance=dynmo"], "dynmo.profile=true"),
        ([*ON[:1], "dynmo.rebalance=greedy"], "static | dynmo | diffusion"),
        ([*ON, "dynmo.rebalance_interval=0"], "integer >= 1"),
        ([*ON, "dynmo.memory_cap_bytes=-1"], ">= 0"),
        ([*ON, "parallel.pp=1"], "pp >= 2 and vpp = 1"),
    ],
)
def test_bad_rebalance_settings_name_the_field(sets, needle):
    with pytest.raises(ConfigError, match=r"^dynmo\.(rebalance|rebalance_interval|memory_cap_bytes): ") as info:
        load_recipe("tiny-cpu", sets)
    assert needle in str(info.value)


def test_rebalance_flags_are_the_set_entries_they_name():
    parser = argparse.ArgumentParser()
    add_dynmo_args(parser)
    args = parser.parse_args(["--dynmo-profile", "--dynmo-rebalance", "diffusion", "--dynmo-rebalance-interval", "3"])
    d = load_recipe("tiny-cpu", dynmo_overrides(args)).dynmo
    assert (d.rebalance, d.rebalance_interval, d.memory_cap_bytes) == ("diffusion", 3, 0.0)
    assert load_recipe("tiny-cpu").dynmo.rebalance == "static"
    with pytest.raises(SystemExit):
        parser.parse_args(["--dynmo-rebalance", "sometimes"])


def test_every_split_the_trigger_can_propose_is_priced_like_brute_force():
    profile = _frozen_prefix_profile(6, 2)
    model = StageModel(**{**MODEL.__dict__, "in_flight": (3, 2, 1)})
    d = decide(1, "dynmo", profile, Partition((2, 2, 2)), model, 10)
    splits = [(a, b - a, 6 - b) for a, b in itertools.combinations(range(1, 6), 2)]
    best = min(max(_stage_times_by_hand(profile, s, model)) for s in splits)
    assert max(_stage_times_by_hand(profile, d.proposed, model)) == pytest.approx(best, rel=1e-12)


@pytest.mark.parametrize(
    "extra", ["model.untie_embeddings_and_output_weights=false", "parallel.cp=2", "train.recompute=full"]
)
def test_a_frozen_embedding_is_refused_where_its_no_backward_path_does_not_hold(extra):
    with pytest.raises(ConfigError, match=r"^dynmo\.freeze_embedding: .*allowed: false unless"):
        load_recipe("tiny-cpu", ["dynmo.freeze_embedding=true", extra])
    assert load_recipe("tiny-cpu", ["dynmo.freeze_embedding=true"]).dynmo.freeze_embedding
