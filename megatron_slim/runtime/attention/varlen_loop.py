"""Packed (varlen) attention as a loop of dense calls, one sequence at a time.

Good enough for backends without a packed kernel (torch SDPA, the reference): it syncs once
to read the boundaries and launches one dense call per non-empty sequence.
"""

from __future__ import annotations

import torch

from megatron_slim.runtime.attention.checks import check_varlen, varlen_lengths

Tensor = torch.Tensor


def nonempty_sequence_rows(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, causal: bool
) -> list[tuple[slice, slice]]:
    """Checks the packed inputs, then gives each sequence's (query rows, key rows), leaving out the
    sequences with no queries or no keys (they have nothing to compute)."""
    check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k)
    cq, ck = varlen_lengths(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], causal)
    return [
        (slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1]))
        for i in range(len(cq) - 1)
        if cq[i + 1] != cq[i] and ck[i + 1] != ck[i]
    ]
