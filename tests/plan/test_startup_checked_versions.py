"""Packing under tp/cp matches Megatron-LM's own runs on megatron-core 0.16 only
(tests/real_megatron/test_packing_tp_cp_launch.py failed on 0.19): newer megatron-cores are refused at
start-up, by name. The launcher's vocabulary exchange matches them on 0.16 and 0.19
(tests/real_megatron/test_vocab_parallel_launch.py) and is no longer refused by version."""

import pytest

from megatron_slim.plan.schema import ConfigError
from megatron_slim.plan.startup import LAUNCHER, RULES, broken_rule, check
from megatron_slim.plan.startup.settings import Settings

VERSION_RULES = [r for r in RULES if r.name.endswith("-megatron-core")]
VOCAB = dict(slimpipe=True, pp=2, vocab_parallel=True)
PACKED = dict(slimpipe=True, pp=2, packing="slimpack", per_token_loss=True, tp=2)


@pytest.mark.parametrize("version", [(0, 17), (0, 19)])
def test_newer_megatron_cores_refuse_packing_under_tp_cp(version):
    settings = Settings(**PACKED, megatron_core=version)
    assert broken_rule(settings, LAUNCHER, VERSION_RULES).name == "packing-tp-cp-megatron-core"
    with pytest.raises(ConfigError) as caught:
        check(settings, LAUNCHER, VERSION_RULES)
    assert f"megatron-core {version[0]}.{version[1]}" in str(caught.value) and "allowed:" in str(caught.value)


def _broken_launcher_rules(settings: Settings) -> list[str]:
    return [r.name for r in RULES if LAUNCHER in r.callers and r.broken(settings)]


@pytest.mark.parametrize("version", [(0, 17), (0, 19)])
def test_vocab_parallel_is_not_refused_by_version(version):
    assert "vocab-parallel-megatron-core" not in [r.name for r in RULES]
    on_016 = _broken_launcher_rules(Settings(**VOCAB, megatron_core=(0, 16)))
    assert _broken_launcher_rules(Settings(**VOCAB, megatron_core=version)) == on_016
    assert broken_rule(Settings(**VOCAB, megatron_core=version), LAUNCHER, VERSION_RULES) is None


def test_megatron_core_016_and_packing_without_tp_cp_run():
    assert [r.name for r in VERSION_RULES] == ["packing-tp-cp-megatron-core"]
    assert broken_rule(Settings(**PACKED, megatron_core=(0, 16)), LAUNCHER, VERSION_RULES) is None
    assert broken_rule(Settings(**dict(PACKED, tp=1), megatron_core=(0, 19)), LAUNCHER, VERSION_RULES) is None
