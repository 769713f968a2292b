"""A rotary-embedding table that stays on the device of its frequencies (CPU included).

megatron-core's ``RotaryEmbedding.get_emb`` moves ``inv_freq`` to ``torch.cuda.current_device()``
on first use, so a CPU model fails in its first forward. This subclass keeps megatron's
constructor and ``get_rotary_seq_len`` and replaces only ``forward``, the one method ``GPTModel``
calls to get the table. ``positions`` is the seam for callers that need non-contiguous or offset
positions (sequence slices, other context-parallel layouts).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

from megatron_slim.megatron import compat


def zigzag_positions(seq_len: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Positions held by ``cp_rank`` under megatron's zigzag split: chunks ``r`` and ``2cp-r-1``
    of ``2*cp_size`` equal chunks."""
    if seq_len % (2 * cp_size):
        raise ValueError(f"seq_len={seq_len}: allowed values are multiples of 2*cp={2 * cp_size}")
    chunk = seq_len // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    second_start = (2 * cp_size - cp_rank - 1) * chunk
    return torch.cat([first, torch.arange(second_start, second_start + chunk)])


class CpuRotaryEmbedding(RotaryEmbedding):
    """RoPE table ``[s, 1, 1, dim]`` computed on ``inv_freq``'s device."""

    def positions(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        """Absolute positions of the tokens (before any context-parallel split), in order."""
        return torch.arange(max_seq_len, device=self.inv_freq.device) + offset

    def forward(
        self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group: Optional[Any] = None, **unused: Any
    ) -> torch.Tensor:
        positions = self.positions(max_seq_len, offset)
        cp_group = cp_group if cp_group is not None else getattr(self, "cp_group", None)
        if cp_group is not None and cp_group.size() > 1 and not packed_seq:
            keep = zigzag_positions(positions.numel(), cp_group.rank(), cp_group.size())
            positions = positions[keep.to(positions.device)]
        return rope_table(self, positions)


def rope_table(rotary: Any, positions: torch.Tensor) -> torch.Tensor:
    """megatron's RoPE table ``[s, 1, 1, dim]`` at explicit ``positions`` (the formula of
    ``RotaryEmbedding.get_emb``), for any rotary module with ``inv_freq``."""
    inv_freq = rotary.inv_freq
    pos = positions.to(device=inv_freq.device, dtype=inv_freq.dtype)
    if getattr(rotary, "seq_len_interpolation_factor", None) is not None:
        pos = pos / rotary.seq_len_interpolation_factor
    freqs = torch.outer(pos, inv_freq)
    if getattr(rotary, "rotary_interleaved", False):
        emb = torch.stack((freqs, freqs), dim=-1).flatten(-2)
    else:
        emb = torch.cat((freqs, freqs), dim=-1)
    return emb[:, None, None, :]


def make_cpu_rotary_embedding(**kwargs: Any) -> CpuRotaryEmbedding:
    """Build :class:`CpuRotaryEmbedding` from ``RotaryEmbedding``'s keyword arguments, dropping the
    ones the installed version does not know (``cp_group`` appeared after 0.14; where the
    constructor lacks it, it is set afterwards so ``forward`` still splits for context
    parallelism)."""
    embedding = compat.call_with_supported(CpuRotaryEmbedding, **kwargs)
    if getattr(embedding, "cp_group", None) is None and kwargs.get("cp_group") is not None:
        embedding.cp_group = kwargs["cp_group"]
    return embedding
