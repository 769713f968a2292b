"""``dynmo.prune``: gradual magnitude pruning of whole FFN neurons on a schedule (pure).

Schedule ``"<first>-<last>:<sparsity>"`` (iterations 1-based, as the log counts them): the share of
each decoder layer's FFN neurons that is pruned follows Zhu & Gupta's (2017) cubic ramp from 0
before iteration ``first`` to ``sparsity`` from iteration ``last`` on,

    s(t) = sparsity * (1 - (1 - (t - first) / (last - first)) ** 3)    for first <= t < last,

so most neurons go early, while the others can still adapt, and few near the end. ``"<first>:<s>"``
prunes to ``s`` at once from iteration ``first``. A layer with ``ffn`` neurons has
``floor(s(t) * ffn)`` of them pruned during iteration ``t`` (never all: ``sparsity < 1``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_slim.plan.schema import ConfigError, fail

PRUNE_FORMAT = '"<first_iteration>-<last_iteration>:<final_sparsity>" (e.g. "5-20:0.5"), or "" for none'


@dataclass(frozen=True)
class PruneSchedule:
    first: int  # the ramp starts (sparsity 0 during this iteration unless first == last)
    last: int  # the final sparsity is reached
    sparsity: float  # in [0, 1)

    def sparsity_at(self, iteration: int) -> float:
        if iteration < self.first:
            return 0.0
        if iteration >= self.last:
            return self.sparsity
        progress = (iteration - self.first) / (self.last - self.first)
        return self.sparsity * (1 - (1 - progress) ** 3)

    def pruned_neurons(self, iteration: int, ffn_size: int) -> int:
        """How many of a layer's ``ffn_size`` neurons are pruned during ``iteration``."""
        # the tiny slack keeps s * ffn that is an integer in exact arithmetic from rounding down a step
        return min(ffn_size - 1, math.floor(self.sparsity_at(iteration) * ffn_size + 1e-9))


def parse_prune(text: str) -> PruneSchedule | None:
    """The schedule ``dynmo.prune`` names, or None for ``""``."""
    text = str(text).strip()
    if not text:
        return None

    def bad(problem: str) -> ConfigError:
        return fail("dynmo.prune", text, PRUNE_FORMAT, problem)

    when, sep, amount = text.partition(":")
    if not sep:
        # YAML reads an unquoted 5:0.5 as the base-60 number 300.5
        raise bad("no ':' between iterations and sparsity; in --set, quote it: dynmo.prune='\"5-20:0.5\"'")
    first, dash, last = when.partition("-")
    try:
        lo = int(first)
        hi = int(last) if dash else lo
        sparsity = float(amount)
    except ValueError:
        raise bad("iterations must be integers and the sparsity a number") from None
    if not 1 <= lo <= hi:
        raise bad("iterations count from 1 and need first <= last")
    if not 0 <= sparsity < 1:
        raise bad("the final sparsity must lie in [0, 1) (a layer keeps at least one neuron)")
    return PruneSchedule(lo, hi, sparsity)
