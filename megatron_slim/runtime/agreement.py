"""Ranks agree on a plan by comparing its hex digest once, before running it.

Every rank of a group builds the same plan (a pipeline schedule, a context-parallel pack plan)
from the same settings; a rank that built a different one would exchange mismatched messages and
hang or compute garbage. ``check_agreement`` all-gathers up to 240 bits of the digest as int64
words (a tensor collective: it runs on the GPU under NCCL, no pickling) and raises on every rank,
naming the ranks that differ, so the failure is loud and simultaneous.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_HEX_PER_WORD, _MAX_WORDS = 15, 4  # 60-bit words fit int64
SHOWN_HEX = 16  # digest characters a disagreement names per rank


def _words(digest: str) -> list[str]:
    head = digest[: _HEX_PER_WORD * _MAX_WORDS]
    return [head[i : i + _HEX_PER_WORD] for i in range(0, len(head), _HEX_PER_WORD)]


def check_agreement(
    digest: str,
    group: dist.ProcessGroup | None,
    *,
    device: torch.device | str = "cpu",
    ranks: str = "CP ranks",
    what: str = "context-parallel plan",
    remedy: str = "every rank must build the same plan from the same pack, topology and planner settings",
) -> None:
    """Collective over ``group``: raise ``RuntimeError`` on every rank unless all hold ``digest``
    (a hex string of the same length on every rank). ``ranks`` / ``what`` / ``remedy`` word the error."""
    size = dist.get_world_size(group)
    if size == 1:
        return
    chunks = _words(digest)
    mine = torch.tensor([int(c, 16) for c in chunks], dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(everyone, mine, group=group)
    texts = ["".join(f"{int(w):0{len(c)}x}" for w, c in zip(t.tolist(), chunks))[:SHOWN_HEX] for t in everyone]
    if len(set(texts)) > 1:
        rank = ranks[:-1] if ranks.endswith("s") else ranks
        listing = ", ".join(f"{rank} {r}: {t}" for r, t in enumerate(texts))
        raise RuntimeError(f"{ranks} disagree on the {what} ({listing}); {remedy}")
