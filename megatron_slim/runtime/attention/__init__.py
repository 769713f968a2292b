"""Attention kernels used by every attention path of megatron-slim.

Layouts (fixed):

- Dense: q ``[b, sq, hq, d]``, k and v ``[b, sk, hkv, d]`` with ``hq % hkv == 0``
  (grouped-query attention: query head i uses kv head ``i // (hq // hkv)``); out
  ``[b, sq, hq, d]`` in q's dtype; lse ``[b, hq, sq]`` float32, the natural-log
  log-sum-exp of each row's scaled scores (-inf for a row that sees no key).
- ``causal=True`` is the bottom-right aligned mask (flash-attn >= 2.1): query row i sees
  keys ``0 .. i + (sk - sq)``. With ``sq == sk`` it is ordinary causal; with ``sq < sk`` the
  queries are the last ``sq`` positions of the key sequence (a K/V-cached slice).
  ``sq > sk`` with causal raises ValueError.
- Varlen (packed): q ``[total_q, hq, d]``, k/v ``[total_k, hkv, d]``, ``cu_seqlens_q`` and
  ``cu_seqlens_k`` int32 of length nseq + 1, ``max_seqlen_q/k`` ints; lse ``[hq, total_q]``
  float32; causal is bottom-right per sequence; sequences may have zero query tokens.

Pieces: ``AttentionBackend`` (forward -> (out, lse), backward -> (dq, dk, dv), varlen
variants), backends ``reference`` / ``sdpa`` / ``flash`` / ``te``, ``select_backend`` (the
only place that picks one), ``merge`` / ``merge_`` (log-sum-exp combination of partials over
disjoint key sets) and the differentiable ``attention`` / ``varlen_attention``.
"""

from megatron_slim.runtime.attention.backend import AttentionBackend
from megatron_slim.runtime.attention.flash import FlashBackend
from megatron_slim.runtime.attention.functional import (
    AttentionFunction,
    VarlenAttentionFunction,
    attention,
    varlen_attention,
)
from megatron_slim.runtime.attention.merge import merge, merge_
from megatron_slim.runtime.attention.reference import ReferenceBackend, bottom_right_causal_mask
from megatron_slim.runtime.attention.sdpa import SdpaBackend
from megatron_slim.runtime.attention.selection import (
    BACKEND_NAMES,
    ENV_VAR,
    BackendChoice,
    choose_backend,
    select_backend,
)
from megatron_slim.runtime.attention.te import TeBackend

__all__ = [
    "BACKEND_NAMES",
    "ENV_VAR",
    "AttentionBackend",
    "AttentionFunction",
    "BackendChoice",
    "FlashBackend",
    "ReferenceBackend",
    "SdpaBackend",
    "TeBackend",
    "VarlenAttentionFunction",
    "attention",
    "bottom_right_causal_mask",
    "choose_backend",
    "merge",
    "merge_",
    "select_backend",
    "varlen_attention",
]
