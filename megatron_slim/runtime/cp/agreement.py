"""What CP ranks agree on before running a data-dependent plan: its fingerprint.

Every CP rank builds its plan from the pack's lengths; a rank that built a different plan (another
pack, another planner version, another topology) would exchange mismatched messages and hang or
compute garbage. The engine compares ``fingerprint`` across the CP group with
``runtime.agreement.check_agreement`` (the helper the pipeline schedule uses too).
"""

from __future__ import annotations

import hashlib
from typing import Optional

from megatron_slim.plan.cp.layout import CPPlan
from megatron_slim.plan.cp.routing import RoutingPlan


def routing_text(routing: Optional[RoutingPlan]) -> str:
    if routing is None:
        return "unrouted"
    return ";".join(f"{h.group}/{h.step}/{h.route}" for h in routing.hops)


def fingerprint(plan: CPPlan, routing: Optional[RoutingPlan] = None, extra: str = "") -> str:
    """sha256 of the plan's digest, its routing and anything else the ranks must share."""
    text = f"{plan.digest()}|{routing_text(routing)}|{extra}"
    return hashlib.sha256(text.encode()).hexdigest()
