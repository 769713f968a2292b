"""The launcher's vocabulary exchange matches Megatron-LM's own runs on megatron-core 0.16 only
(tests/real_megatron/test_vocab_parallel_launch.py failed on 0.19): newer megatron-cores are refused at
start-up, by name. Packing under tensor or context parallelism matches them on 0.16 and 0.19
(test_packing_tp_cp_launch.py), so no megatron-core is refused for it."""

import pytest

from megatron_slim.plan.schema import ConfigError
from megatron_slim.plan.startup import LAUNCHER, RULES, broken_rule, check
from megatron_slim.plan.startup.settings import Settings

VERSION_RULES = [r for r in RULES if r.name.endswith("-megatron-core")]
VOCAB = dict(slimpipe=True, pp=2, vocab_parallel=True)
PACKED = dict(slimpipe=True, pp=2, num_slices=2, seq_length=64, packing="slimpack", per_token_loss=True)


@pytest.mark.parametrize("version", [(0, 17), (0, 19)])
def test_newer_megatron_cores_are_refused_the_vocabulary_exchange(version):
    settings = Settings(**VOCAB, megatron_core=version)
    assert broken_rule(settings, LAUNCHER, VERSION_RULES).name == "vocab-parallel-megatron-core"
    with pytest.raises(ConfigError) as caught:
        check(settings, LAUNCHER, VERSION_RULES)
    assert f"megatron-core {version[0]}.{version[1]}" in str(caught.value) and "allowed:" in str(caught.value)


@pytest.mark.parametrize("version", [(0, 16), (0, 17), (0, 19)])
@pytest.mark.parametrize("layout", [dict(tp=2), dict(cp=2), dict(tp=2, cp=2, pp=1)], ids=["tp2", "cp2", "tp2xcp2"])
def test_packing_under_tp_and_cp_runs_on_every_megatron_core(version, layout):
    settings = Settings(**{**PACKED, **layout}, megatron_core=version)
    assert broken_rule(settings, LAUNCHER, RULES) is None
    check(settings, LAUNCHER, RULES)


def test_megatron_core_016_runs_the_vocabulary_exchange():
    assert "packing-tp-cp-megatron-core" not in {r.name for r in RULES}
    assert broken_rule(Settings(**VOCAB, megatron_core=(0, 16)), LAUNCHER, VERSION_RULES) is None
