"""The launcher refuses to be a silent no-op: megatron-slim flags given to a script whose loop never
parses Megatron-LM's args (Megatron-Bridge) raise the first time a hook needs the args."""

import pytest

from megatron_slim.megatron.launch.guard import guarded, megatron_slim_flags
from megatron_slim.plan.schema import ConfigError


def test_finds_megatron_slim_flags_in_either_spelling_and_nothing_else():
    argv = ["--use-slimpipe", "--seq-length", "64", "--cp-engine=ring", "--slimpipe-num-slices", "4", "--lr", "1"]
    assert megatron_slim_flags(argv) == ["--use-slimpipe", "--cp-engine", "--slimpipe-num-slices"]


def test_unparsed_args_with_our_flags_name_the_flags_and_the_bridge_entry_point():
    with pytest.raises(ConfigError) as caught:
        guarded(lambda: None, ["--use-slimpipe", "--slimpipe-num-slices", "4"])()
    message = str(caught.value)
    assert message.startswith("--use-slimpipe, --slimpipe-num-slices: ")
    assert "Megatron-Bridge" in message and "megatron_slim.megatron.bridge.install(config" in message


def test_parsed_args_or_no_flags_of_ours_pass_through():
    parsed = object()
    assert guarded(lambda: parsed, ["--use-slimpipe"])() is parsed
    assert guarded(lambda: None, ["--seq-length", "64"])() is None
