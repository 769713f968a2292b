"""``dynmo.mod_capacity``: which layers route tokens under mixture of depths, and how many (pure).

As in Raposo et al. (2024), every other decoder layer routes: the layers with an odd global index
(1, 3, 5, ...). Such a layer processes the ``max(1, floor(capacity * seq))`` tokens of each sequence
with the largest router scores; the others pass it unchanged (residual only).
"""

from __future__ import annotations

import math


def routes(layer_index: int, capacity: float) -> bool:
    """Whether global layer ``layer_index`` (0-based) is a mixture-of-depths layer."""
    return capacity > 0 and layer_index % 2 == 1


def routed_tokens(seq_length: int, capacity: float) -> int:
    """How many of a sequence's ``seq_length`` tokens a routing layer processes."""
    # the tiny slack keeps an exact product (0.5 * 32) from rounding down a token
    return max(1, min(seq_length, math.floor(capacity * seq_length + 1e-9)))
