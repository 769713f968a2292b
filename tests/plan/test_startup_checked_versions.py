"""The launcher's vocabulary exchange and packing under tensor or context parallelism match Megatron-LM's
own runs on megatron-core 0.16.1 and 0.19.0 (tests/real_megatron/test_vocab_parallel_launch.py,
test_packing_tp_cp_launch.py), so start-up refuses them on no megatron-core: 0.17 and 0.19 get exactly
0.16's refusals (a rule keyed on the version, as these two had until 2026-11-26, would show up here)."""

import pytest

from megatron_slim.plan.startup import LAUNCHER, RULES, broken_rule, check
from megatron_slim.plan.startup.settings import Settings

VOCAB = dict(slimpipe=True, pp=2, num_slices=2, seq_length=64, vocab_parallel=True)
PACKED = dict(slimpipe=True, pp=2, num_slices=2, seq_length=64, packing="slimpack", per_token_loss=True)
LAYOUTS = {
    "vocab-pp2": VOCAB,
    "packing-tp2": dict(PACKED, tp=2),
    "packing-cp2": dict(PACKED, cp=2),
    "packing-tp2xcp2": dict(PACKED, tp=2, cp=2, pp=1),
}


def _refused(settings: Settings) -> list[str]:
    return [r.name for r in RULES if LAUNCHER in r.callers and r.broken(settings)]


def test_no_rule_is_keyed_on_the_megatron_core_version_for_these_paths():
    assert not [r.name for r in RULES if r.name.endswith("-megatron-core")]


@pytest.mark.parametrize("version", [(0, 17), (0, 19)])
@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_newer_megatron_cores_get_016s_refusals(version, layout):
    assert _refused(Settings(**layout, megatron_core=version)) == _refused(Settings(**layout, megatron_core=(0, 16)))


@pytest.mark.parametrize("version", [(0, 16), (0, 17), (0, 19)])
@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_these_paths_start_on_every_megatron_core(version, layout):
    settings = Settings(**layout, megatron_core=version)
    assert broken_rule(settings, LAUNCHER, RULES) is None
    check(settings, LAUNCHER, RULES)
