"""megatron-core's THD packing (``PackedSeqParams``) read as the documents of one packed window.

With ``packed_seq_params.qkv_format == 'thd'`` megatron's ``Attention.forward`` squeezes the dummy
batch dimension before the core attention: query ``[t, np, hn]``, key/value ``[t, ng, hn]``, and
it reshapes the core attention's output to ``[t, 1, np * hn]`` itself. ``cu_seqlens_q`` gives each
sequence's real tokens; ``cu_seqlens_q_padded`` (optional) where each sequence starts in the tensor:
sequence ``i`` holds tokens ``[padded[i], padded[i] + len_i)`` followed by padding up to
``padded[i + 1]``. megatron's THD RoPE restarts positions at each padded start.

A padded sequence is therefore one document of its padded length: its padding sits after its real
tokens, so causal attention keeps the real tokens blind to it. The padding rows' outputs are zeroed
(Transformer Engine leaves them unspecified; loss masks drop them), which also gives them zero
gradients.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

PACKED_SEQ_PARAMS = "packed_seq_params"


@dataclass(frozen=True)
class ThdDocuments:
    """The documents of a THD pack, in tensor order."""

    lengths: tuple[int, ...]  # per document: its rows in the tensor (padding included)
    real: tuple[int, ...]  # per document: its real tokens (the first rows of its segment)

    @property
    def padded(self) -> bool:
        return self.lengths != self.real

    def real_rows(self, device: torch.device) -> torch.Tensor:
        """Bool ``[t]``: True for a real token, False for padding."""
        rows = [
            flag for length, real in zip(self.lengths, self.real) for flag in [True] * real + [False] * (length - real)
        ]
        return torch.tensor(rows, dtype=torch.bool, device=device)


def _host_offsets(name: str, cu: Any) -> list[int]:
    if not torch.is_tensor(cu) or cu.dim() != 1 or cu.numel() < 2 or cu.is_floating_point():
        shape = tuple(cu.shape) if torch.is_tensor(cu) else type(cu).__name__
        raise ValueError(f"{PACKED_SEQ_PARAMS}.{name}={shape}: allowed: a 1-D integer tensor of nseq + 1 offsets")
    offsets = [int(x) for x in cu.tolist()]
    if offsets[0] != 0 or any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"{PACKED_SEQ_PARAMS}.{name}={offsets}: allowed: offsets starting at 0, non-decreasing")
    return offsets


def _same_for_keys(params: Any, q_name: str, kv_name: str) -> Optional[list[int]]:
    """The offsets of ``q_name``, refusing a different ``kv_name`` (self-attention packs only)."""
    q, kv = getattr(params, q_name, None), getattr(params, kv_name, None)
    if q is None and kv is None:
        return None
    if q is None or kv is None or q.shape != kv.shape or not torch.equal(q.cpu(), kv.cpu()):
        raise ValueError(
            f"{PACKED_SEQ_PARAMS}: {q_name}={None if q is None else q.tolist()} and "
            f"{kv_name}={None if kv is None else kv.tolist()}; allowed: equal tensors (self-attention over one pack)"
        )
    return _host_offsets(q_name, q)


def _check_no_cp(params: Any, cp_size: int) -> None:
    local_cp = getattr(params, "local_cp_size", None)
    group = getattr(params, "cp_group", None)
    sizes = {"context parallel size": cp_size, "local_cp_size": local_cp or 1}
    sizes[f"{PACKED_SEQ_PARAMS}.cp_group size"] = group.size() if group is not None else 1
    for name, size in sizes.items():
        if size != 1:
            raise ValueError(
                f"{PACKED_SEQ_PARAMS} (THD) with {name} {size}: allowed: 1 (megatron's per-sequence THD "
                "context-parallel split is not supported; use megatron-slim's CP engine with unpacked batches)"
            )


def thd_documents(params: Any, total_tokens: int, cp_size: int = 1) -> ThdDocuments:
    """The documents of a THD pack of ``total_tokens`` rows, validated against what we support:
    ``qkv_format='thd'``, equal query and key offsets, no context parallelism."""
    if getattr(params, "qkv_format", None) != "thd":
        raise ValueError(f"{PACKED_SEQ_PARAMS}.qkv_format={getattr(params, 'qkv_format', None)!r}: allowed: 'thd'")
    _check_no_cp(params, cp_size)
    real = _same_for_keys(params, "cu_seqlens_q", "cu_seqlens_kv")
    if real is None:
        raise ValueError(f"{PACKED_SEQ_PARAMS}.cu_seqlens_q=None: allowed: a 1-D integer tensor of nseq + 1 offsets")
    padded = _same_for_keys(params, "cu_seqlens_q_padded", "cu_seqlens_kv_padded") or real
    if len(padded) != len(real):
        raise ValueError(
            f"{PACKED_SEQ_PARAMS}: cu_seqlens_q_padded={padded} and cu_seqlens_q={real} count different "
            "sequences; allowed: the same number of offsets"
        )
    segments = [b - a for a, b in zip(padded, padded[1:])]
    tokens = [b - a for a, b in zip(real, real[1:])]
    if any(n > seg for n, seg in zip(tokens, segments)):
        raise ValueError(
            f"{PACKED_SEQ_PARAMS}: cu_seqlens_q={real} has a sequence longer than its padded slot in "
            f"cu_seqlens_q_padded={padded}; allowed: padded lengths >= real lengths"
        )
    if padded[-1] != total_tokens:
        raise ValueError(
            f"{PACKED_SEQ_PARAMS}: the {'padded ' if padded is not real else ''}offsets end at {padded[-1]} but "
            f"the packed query has {total_tokens} tokens; allowed: offsets ending at the token count"
        )
    kept = [(seg, n) for seg, n in zip(segments, tokens) if seg > 0]
    return ThdDocuments(tuple(seg for seg, _ in kept), tuple(n for _, n in kept))
