"""How an all-to-all group shares attention heads (Ulysses, and the node level of hierarchical).

Member ``j`` of ``ways`` gets query heads ``[j*hq/ways, (j+1)*hq/ways)`` and the K/V heads they read
(query head ``i`` reads K/V head ``i // (hq/hkv)``). With at least one K/V head per member the K/V
heads are split; with fewer K/V heads than members each K/V head is replicated to the members that
share it, and the backward sums its gradient over them. Head counts that fit neither are refused.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeadSplit:
    q: tuple[tuple[int, int], ...]  # per member: [lo, hi) of query heads
    kv: tuple[tuple[int, int], ...]  # per member: [lo, hi) of K/V heads

    @property
    def ways(self) -> int:
        return len(self.q)

    def q_count(self, member: int) -> int:
        lo, hi = self.q[member]
        return hi - lo

    def kv_count(self, member: int) -> int:
        lo, hi = self.kv[member]
        return hi - lo


def split_heads(hq: int, hkv: int, ways: int, *, what: str = "all-to-all group") -> HeadSplit:
    if ways < 1 or hkv < 1 or hq % hkv:
        raise ValueError(f"split_heads: hq={hq}, hkv={hkv}, ways={ways}: need ways >= 1 and hkv dividing hq")
    group = hq // hkv
    if hq % ways:
        raise ValueError(
            f"{what} of {ways} ranks cannot share {hq} query heads (per tensor-parallel rank): "
            f"the head count must be divisible by {ways}; use engine ring, zeppelin without "
            "hierarchical splits, or allgather"
        )
    per = hq // ways
    if per % group == 0:
        kv = tuple((j * per // group, (j + 1) * per // group) for j in range(ways))
    elif group % per == 0:
        kv = tuple((j * per // group, j * per // group + 1) for j in range(ways))
    else:
        raise ValueError(
            f"{what} of {ways} ranks: {per} query heads per rank do not align with groups of "
            f"{group} query heads per K/V head (hq={hq}, hkv={hkv}); allowed: {group} dividing "
            f"{per} or {per} dividing {group}"
        )
    return HeadSplit(tuple((j * per, (j + 1) * per) for j in range(ways)), kv)
