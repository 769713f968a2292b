"""`parallel.layers_per_stage`: an uneven pipeline split in a recipe (DynMo), checked before any work."""

import pytest

from megatron_slim.plan.dynmo.partition import Partition
from megatron_slim.plan.recipe import load_recipe
from megatron_slim.plan.schema import ConfigError


def test_an_uneven_split_loads_and_round_trips():
    recipe = load_recipe("tiny-cpu", ["parallel.pp=4", "parallel.layers_per_stage=[1,2,4,1]"])
    assert recipe.parallel.layers_per_stage == (1, 2, 4, 1)
    assert recipe.to_dict()["parallel"]["layers_per_stage"] == [1, 2, 4, 1]
    assert load_recipe("tiny-cpu").parallel.layers_per_stage == ()  # the even split by default


@pytest.mark.parametrize(
    "sets,needle",
    [
        (["parallel.pp=2", "parallel.layers_per_stage=[4,2,2]"], "2 integers >= 1 (one per stage, parallel.pp=2)"),
        (["parallel.pp=2", "parallel.layers_per_stage=[8,0]"], "2 integers >= 1"),
        (["parallel.pp=2", "parallel.layers_per_stage=[5,4]"], "summing to model.num_layers=8"),
        (
            [
                "parallel.pp=2",
                "parallel.vpp=2",
                "schedule.kind=interleaved",
                "schedule.num_slices=1",
                "parallel.layers_per_stage=[6,2]",
            ],
            "[] (the even split) when parallel.vpp > 1",
        ),
    ],
)
def test_bad_splits_name_the_field_and_the_allowed_values(sets, needle):
    with pytest.raises(ConfigError) as err:
        load_recipe("tiny-cpu", sets)
    assert "parallel.layers_per_stage" in str(err.value) and needle in str(err.value)


def test_uniform_recompute_groups_must_divide_every_stage():
    base = ["parallel.pp=2", "train.recompute=full", "train.recompute_method=uniform"]
    load_recipe("tiny-cpu", [*base, "train.recompute_num_layers=2", "parallel.layers_per_stage=[6,2]"])
    with pytest.raises(ConfigError, match=r"a divisor of every stage's layers \[3, 5\]: \[1\]"):
        load_recipe("tiny-cpu", [*base, "train.recompute_num_layers=3", "parallel.layers_per_stage=[3,5]"])


def test_partition_even_is_the_default_split_of_a_divisible_model():
    assert Partition.even(8, 4).layers_per_stage == (2, 2, 2, 2)


def test_the_interleaved_variant_of_an_uneven_recipe_takes_the_even_split():
    from megatron_slim.plan.variants import schedule_variant

    recipe = load_recipe("tiny-cpu", ["parallel.layers_per_stage=[1,2,4,1]"])
    variant = schedule_variant(recipe, "interleaved")
    assert (variant.parallel.vpp, variant.parallel.layers_per_stage) == (2, ())
    assert schedule_variant(recipe, "slimpipe").parallel.layers_per_stage == (1, 2, 4, 1)
