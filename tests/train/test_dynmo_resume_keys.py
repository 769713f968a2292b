"""Resuming across the ``dynmo:`` section: checkpoints saved before it existed still resume, the
profile, the freeze and the prune schedules may change, early exit (the model's semantics) may not."""

from megatron_slim.plan.recipe import load_recipe
from megatron_slim.train.checkpoint.resume import differing_keys


def _recipe(*sets):
    return load_recipe("tiny-cpu", list(sets)).to_dict()


def test_a_checkpoint_without_the_section_counts_as_its_defaults():
    saved = {k: v for k, v in _recipe().items() if k != "dynmo"}
    assert differing_keys(saved, _recipe()) == []
    assert differing_keys(saved, _recipe("dynmo.exit_threshold=0.2")) == ["dynmo.exit_threshold"]


def test_profile_and_freeze_may_change_early_exit_may_not():
    saved = _recipe()
    changed = _recipe(
        "dynmo.profile=true", "dynmo.profile_smoothing=0.2", 'dynmo.freeze="3:0-1"', 'dynmo.prune="2-4:0.5"'
    )
    assert differing_keys(saved, changed) == []
    exits = _recipe("dynmo.exit_threshold=0.2", "dynmo.exit_from_layer=3")
    assert differing_keys(saved, exits) == ["dynmo.exit_from_layer", "dynmo.exit_threshold"]
