"""Start-up rules on activation offloading (``train.offload_ratio``, ``--slimpipe-offload-ratio``).

The offload runs in megatron-slim's pipeline interpreter (``megatron/slimpipe/offload_layers``):
under ``megatron-slim train`` for any schedule kind, under Megatron-LM's launcher only in the SlimPipe
schedule (Megatron's own schedules have no such hook). It moves the activations of the layers that
keep theirs, so under full uniform recomputation, where every layer keeps only its checkpoint input,
it would move nothing. Under context parallelism it runs as it does without (SlimPipe's query-out CP
and slices that follow a CP engine's plan: ``tests/real_megatron/test_offload_launch.py``).
"""

from __future__ import annotations

from megatron_slim.plan.startup.rule import Rule
from megatron_slim.plan.startup.settings import LAUNCHER, MEGATRON_ARGS, TRAIN, Settings


def _offloads(s: Settings) -> bool:
    return s.offload_ratio != 0


def _full_uniform(s: Settings) -> bool:
    # Megatron-LM's --recompute-granularity full without a method is refused by megatron-core; a
    # recipe's unset train.recompute_method under full means uniform
    return s.recompute == "full" and s.recompute_method in (None, "uniform")


RECOMPUTE_RULES = [
    Rule(
        "offload-range",
        (LAUNCHER,),
        lambda s: not 0.0 <= s.offload_ratio <= 1.0,
        lambda s, i: f"--slimpipe-offload-ratio: got {s.offload_ratio}; allowed: a fraction in [0, 1]",
    ),
    Rule(
        "offload-needs-slimpipe",
        (LAUNCHER, MEGATRON_ARGS),
        lambda s: _offloads(s) and not s.slimpipe,
        lambda s, i: (
            f"{i.name('offload_ratio')}: got {s.offload_ratio} without {i.setting('slimpipe', True)}; the per-slice "
            "activation offload runs in the SlimPipe schedule, Megatron-LM's own schedules have no such hook "
            "(its --cpu-offloading-num-layers moves whole layers and refuses pipeline parallelism and "
            f"recomputation); allowed: {i.setting('slimpipe', True)}, or {i.setting('offload_ratio', 0)}"
        ),
    ),
    Rule(
        "offload-full-uniform",
        (LAUNCHER, MEGATRON_ARGS, TRAIN),
        lambda s: _offloads(s) and _full_uniform(s),
        lambda s, i: (
            f"{i.name('offload_ratio')}: got {s.offload_ratio} with {i.setting('recompute', 'full')} and "
            f"{i.setting('recompute_method', s.recompute_method or 'uniform')}: every layer keeps only its checkpoint "
            "input, so no layer keeps activations to offload; allowed: "
            f"{i.setting('offload_ratio', 0)}, or {i.setting('recompute_method', 'block')} "
            "(the layers after the first N keep theirs), selective or no recomputation"
        ),
    ),
]
