"""A CP engine's planned windows cut into SlimPipe slices: what ``megatron-slim train``
(``train/cp_slices.py``) and the Megatron-LM launcher (``megatron/slimpipe/engine_slices.py``) share.

Each window is planned once (``cp.data.plan_microbatch``); ``plan/cp/slices.slice_shares`` cuts the
plan into the schedule's slices, and every slice runs this CP rank's rows of its share
(``rows_of_share``). The pipeline stages (and the CP ranks) of a run compare one digest of the
call's plans (``plans_digest``) before any slice runs.
"""

from __future__ import annotations

import hashlib
from typing import Any, Sequence

import torch

from megatron_slim.plan.cp.slices import SliceShare, slice_shares

Planned = tuple  # (CPPlan, RoutingPlan | None, RemapPlan | None), as plan_microbatch returns it


def plans_digest(plans: Sequence[Planned]) -> str:
    """One sha256 over the fingerprints of a call's plans (placement, routing, remap)."""
    from megatron_slim.runtime.cp.agreement import fingerprint

    prints = [fingerprint(p, r, m.digest() if m is not None else "no-remap") for p, r, m in plans]
    return hashlib.sha256("|".join(prints).encode()).hexdigest()


def window_shares(plans: Sequence[Planned], slice_lengths: Sequence[int]) -> list[tuple[SliceShare, ...]]:
    """Each planned window's slice shares, in microbatch order."""
    return [slice_shares(plan, tuple(slice_lengths)) for plan, _, _ in plans]


def rows_of_share(batch: dict, share: SliceShare, cp_rank: int) -> dict:
    """``cp_rank``'s rows of a slice's per-token tensors (``[b, share.length, ...]``) under a CP plan's
    ``share``, keys in their order; ``attention_mask`` becomes None (the slice attention masks per
    document itself), anything else passes. A rank the plan leaves without tokens gets one padding row,
    out of the loss (``loss_mask`` 0)."""
    rows = torch.tensor(share.local_rows(cp_rank), dtype=torch.long)
    empty = share.tokens(cp_rank) == 0
    local: dict[str, Any] = {}
    for name, value in batch.items():
        if name == "attention_mask":
            local[name] = None
        elif torch.is_tensor(value) and value.dim() >= 2 and value.shape[1] == share.length:
            local[name] = value[:, rows.to(value.device)]
            if empty and name == "loss_mask":
                local[name] = torch.zeros_like(local[name])
        else:
            local[name] = value
    return local
