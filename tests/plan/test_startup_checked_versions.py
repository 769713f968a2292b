"""The launcher's vocabulary exchange and packing under tp/cp match Megatron-LM's own runs on
megatron-core 0.16 only (tests/real_megatron/test_vocab_parallel_launch.py and
test_packing_tp_cp_launch.py failed on 0.19): newer megatron-cores are refused at start-up, by name."""

import pytest

from megatron_slim.plan.schema import ConfigError
from megatron_slim.plan.startup import LAUNCHER, RULES, broken_rule, check
from megatron_slim.plan.startup.settings import Settings

VERSION_RULES = [r for r in RULES if r.name in ("vocab-parallel-megatron-core", "packing-tp-cp-megatron-core")]
VOCAB = dict(slimpipe=True, pp=2, vocab_parallel=True)
PACKED = dict(slimpipe=True, pp=2, packing="slimpack", per_token_loss=True, tp=2)


@pytest.mark.parametrize("version", [(0, 17), (0, 19)])
def test_newer_megatron_cores_are_refused(version):
    assert (
        broken_rule(Settings(**VOCAB, megatron_core=version), LAUNCHER, VERSION_RULES).name
        == "vocab-parallel-megatron-core"
    )
    assert (
        broken_rule(Settings(**PACKED, megatron_core=version), LAUNCHER, VERSION_RULES).name
        == "packing-tp-cp-megatron-core"
    )
    for settings in (Settings(**VOCAB, megatron_core=version), Settings(**PACKED, megatron_core=version)):
        with pytest.raises(ConfigError) as caught:
            check(settings, LAUNCHER, VERSION_RULES)
        assert f"megatron-core {version[0]}.{version[1]}" in str(caught.value) and "allowed:" in str(caught.value)


def test_megatron_core_016_and_packing_without_tp_cp_run():
    assert len(VERSION_RULES) == 2
    assert broken_rule(Settings(**VOCAB, megatron_core=(0, 16)), LAUNCHER, VERSION_RULES) is None
    assert broken_rule(Settings(**PACKED, megatron_core=(0, 16)), LAUNCHER, VERSION_RULES) is None
    assert broken_rule(Settings(**dict(PACKED, tp=1), megatron_core=(0, 19)), LAUNCHER, VERSION_RULES) is None
