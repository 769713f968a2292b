"""Prices one ring's steps of the CP program (a zigzag group, or one local index of a hierarchical one).

Member ``i`` (see ``plan.cp.program``):

* ``C t`` computes its queries against the block of member ``i - t`` (step 0: its own block, ready
  once its QKV projection / output gradient exists); it waits for the step's K/V and for step
  ``t - 1`` (the softmax merge is sequential).
* ``POST_KV t`` is priced as the hop *into* ``i`` from member ``i - 1``: it starts when the sender
  holds the block (step 1: its own; later: the one it received at ``t - 1``) and when ``i``'s
  double buffer is free (its compute of step ``t - 2`` is done).
* ``POST_DKV t`` (backward) carries the block's gradient accumulated so far into ``i``; it leaves
  once the sender's step ``t - 1`` kernel is done and its own incoming accumulator has arrived. As
  in ring flash-attention a kernel does not wait for the incoming dK/dV (only the cheap
  accumulation does), so that hop overlaps the next kernel. Step ``g`` takes it home. Backward
  compute is ``CPCosts.pair_bwd_s`` per pair (2.5x the forward FLOPs at the backward efficiency).
* ``WAIT``/``ROUND`` cost nothing here: the waits are the dependencies above. Routed groups send
  inter-node hops through the routing plan's parts; a relay rank's steps cost nothing itself (the
  parts it carries are priced with the receiver's hop).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_slim.plan.cp.layout import CPGroup
from megatron_slim.plan.cp.program import Step
from megatron_slim.plan.cp.zigzag import causal, chunk_bounds

if TYPE_CHECKING:  # attention imports this module
    from megatron_slim.plan.sim.cp.attention import AttentionBuilder


def ring_pairs(lengths: list[int], ring: int) -> list[list[int]]:
    """``pairs[i][j]``: causal pairs member ``i`` computes with the block of member ``j``."""
    pairs = [[0] * ring for _ in range(ring)]
    for s in lengths:
        b = chunk_bounds(s, 2 * ring)
        n = [b[k + 1] - b[k] for k in range(2 * ring)]
        for i in range(ring):
            a, z = n[i], n[2 * ring - 1 - i]
            row = pairs[i]
            row[i] += causal(a) + causal(z) + z * a
            for j in range(i):
                row[j] += (a + z) * n[j]
            for j in range(i + 1, ring):
                row[j] += z * (n[j] + n[2 * ring - 1 - j])
    return pairs


class RingPricer:
    def __init__(
        self,
        builder: AttentionBuilder,
        group: CPGroup,
        ranks: list[int],
        lengths: list[int],
        ready: dict[int, int],
        block_rows: list[float],
        head_share: float,
        kv_share: float,
        sub: int,
    ) -> None:
        self.b, self.group, self.ranks, self.ready = builder, group, ranks, ready
        self.block_rows, self.head_share, self.sub = block_rows, head_share, sub
        self.position = {r: i for i, r in enumerate(ranks)}
        self.pairs = ring_pairs(lengths, len(ranks))
        self.kvb = builder.costs.kv_bytes * kv_share
        self.detail = f"ring {sub}" if group.kind == "hierarchical" else ""
        self.comp: dict[tuple[int, int], int] = {}
        self.kv: dict[tuple[int, int], int] = {}
        self.dkv: dict[tuple[int, int], int] = {}
        self.home: dict[int, int] = {}

    def _grad_ready(self, i: int, t: int) -> tuple[int, ...]:
        """Member i's accumulated dK/dV of the block it computed at step t can leave."""
        return (self.comp[(i, t)],) + ((self.dkv[(i, t)],) if t >= 1 else ())

    def _into(self, i: int, step: int, src: int, rows: float, deps: tuple[int, ...], name: str, detail: str) -> int:
        """The hop of ring step ``step`` into member ``i`` from rank ``src``: ``rows`` K/V (or dK/dV) rows."""
        return self.b.hop(self.group, step, src, self.ranks[i], rows, self.kvb, deps, name, detail)

    def price(self, rank: int, step: Step, name: str) -> None:
        """Add ``rank``'s tasks of ``step``, named ``name`` (the step's ``GroupTask.step_name``)."""
        if rank not in self.position or step.op not in ("C", "POST"):
            return
        i, t, g = self.position[rank], step.step, len(self.ranks)
        prev = (i - 1) % g
        if step.op == "C":
            deps = (self.ready[rank],) if t == 0 else (self.kv[(i, t)], self.comp[(i, t - 1)])
            self.comp[(i, t)] = self.b.attn(
                rank,
                self.pairs[i][(i - t) % g] * self.head_share,
                deps,
                (self.group.priority, self.group.index, t, self.sub),
                name,
                self.detail,
            )
            if g == 1 and self.b.backward:  # a one-member ring hands its dK/dV "home" to itself
                self.home[i] = self._into(i, 1, rank, self.block_rows[0], self._grad_ready(0, 0), name, "dK/dV home")
        elif step.what == "KV":
            buffer = (self.comp[(i, t - 2)],) if t >= 2 else ()
            have = (self.ready[self.ranks[prev]],) if t == 1 else (self.kv[(prev, t - 1)],)
            rows = self.block_rows[(i - t) % g]
            self.kv[(i, t)] = self._into(i, t, self.ranks[prev], rows, have + buffer, name, self.detail)
        elif t < g:
            rows, ready = self.block_rows[(i - t) % g], self._grad_ready(prev, t - 1)
            self.dkv[(i, t)] = self._into(i, t, self.ranks[prev], rows, ready, name, self.detail)
        else:
            detail = ", ".join(filter(None, (self.detail, "home")))
            ready = self._grad_ready(prev, g - 1)
            self.home[i] = self._into(i, g, self.ranks[prev], self.block_rows[i], ready, name, detail)

    def final(self, rank: int) -> list[int]:
        """What ``rank``'s post-attention work waits for: its last kernel (and, backward, its own
        block's gradient come home)."""
        i = self.position[rank]
        return [self.comp[(i, len(self.ranks) - 1)]] + ([self.home[i]] if i in self.home else [])

    def finals(self) -> dict[int, list[int]]:
        return {r: self.final(r) for r in self.ranks}
