"""docs/composition.md is the start-up rules' own answer, pair by pair, and stays current."""

import pytest

from megatron_slim.plan.schema import ConfigError
from megatron_slim.plan.startup import LAUNCHER, check
from megatron_slim.plan.startup.composition import FEATURES, _settings, markdown, refusals
from scripts.composition import DOC


def test_the_document_is_what_the_rules_say_now():
    assert DOC.read_text() == markdown(), "docs/composition.md is out of date: run python scripts/composition.py"


def test_each_feature_runs_alone_but_vocab_on_all_ranks_in_bf16():
    alone = {name: refusals(name) for name in FEATURES}
    assert {name: r for name, r in alone.items() if r} == {"vocab on all ranks": ["vocab-parallel-megatron"]}


@pytest.mark.parametrize(
    "pair, rule",
    [
        (("zeppelin", "vpp"), "cp-engine-virtual-pipeline"),
        (("activation offload", "full recompute"), "offload-full-uniform"),
    ],
)
def test_a_refused_cell_is_what_the_launcher_refuses(pair, rule):
    assert refusals(*pair) == [rule]
    with pytest.raises(ConfigError):
        check(_settings(*pair), LAUNCHER)
    assert refusals("zeppelin", "ring") is None  # two engines are alternatives, not a pair
