"""Ranks agree on a data-dependent plan by comparing its hash once, before running it.

Every CP rank builds its plan from the pack's lengths; a rank that built a different plan (another
pack, another planner version, another topology) would exchange mismatched messages and hang or
compute garbage. ``check_agreement`` all-gathers 240 bits of the fingerprint and raises on every
rank, naming the ranks that differ, so the failure is loud and simultaneous.
"""
from __future__ import annotations

import hashlib
from typing import Optional

import torch
import torch.distributed as dist

from megatron_slim.plan.cp.layout import CPPlan
from megatron_slim.plan.cp.routing import RoutingPlan
from megatron_slim.runtime.cp.comm import Comm

_WORDS, _HEX = 4, 15  # 4 x 60-bit words fit int64


def routing_text(routing: Optional[RoutingPlan]) -> str:
    if routing is None:
        return "unrouted"
    return ";".join(f"{h.group}/{h.step}/{h.route}" for h in routing.hops)


def fingerprint(plan: CPPlan, routing: Optional[RoutingPlan] = None, extra: str = "") -> str:
    """sha256 of the plan's digest, its routing and anything else the ranks must share."""
    text = f"{plan.digest()}|{routing_text(routing)}|{extra}"
    return hashlib.sha256(text.encode()).hexdigest()


def check_agreement(digest: str, comm: Comm, device: torch.device | str = "cpu",
                    what: str = "context-parallel plan") -> None:
    """Collective over ``comm``'s group: raise ``RuntimeError`` on every rank unless all hold ``digest``."""
    if comm.size == 1:
        return
    mine = torch.tensor([int(digest[i * _HEX:(i + 1) * _HEX], 16) for i in range(_WORDS)], dtype=torch.int64,
                        device=device)
    everyone = [torch.empty_like(mine) for _ in range(comm.size)]
    dist.all_gather(everyone, mine, group=comm.group)
    texts = ["".join(f"{int(w):015x}" for w in t.tolist())[:16] for t in everyone]
    if len(set(texts)) > 1:
        listing = ", ".join(f"CP rank {r}: {t}" for r, t in enumerate(texts))
        raise RuntimeError(f"CP ranks disagree on the {what} ({listing}); every rank must build the same plan "
                           "from the same pack, topology and planner settings")
