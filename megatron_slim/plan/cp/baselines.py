"""Placements of the engines Zeppelin is compared with, on the same pack and topology.

* ``ring`` -- Transformer Engine's THD p2p CP: every sequence zigzag-split over all ``C`` ranks,
  one ring in CP-rank order (only the hops between nodes cross a NIC, each on the sender's own
  NIC share; no routing).
* ``ulysses`` -- all-to-all head parallelism over all ``C`` ranks; the pack is cut into ``C``
  contiguous token slices. Needs ``C`` to divide the attention heads (checked); with fewer K/V
  heads than ``C`` the K/V heads are replicated, as DeepSpeed and TE do.
* ``a2a+p2p`` -- TE's hierarchical CP: all-to-all inside each node, zigzag ring across nodes,
  every sequence spread over all ranks. Needs the ranks per node to divide the heads (checked);
  one node degenerates to Ulysses, one rank per node to ``ring``.
* ``allgather`` -- Llama-3 CP: queries zigzag-split per sequence like ``ring``; the K/V of all
  ranks are all-gathered before attention (not overlapped), dK/dV reduce-scattered after.
* ``dynamic`` -- Megatron dynamic CP (``BalancedCPScheduler``): a sequence of ``s`` tokens gets
  ``2^ceil(log2(s / budget))`` ranks (at least 1, at most the largest power of two dividing
  ``C``) with ``budget = ceil(L / C)`` (``--max-seqlen-per-dp-cp-rank``), placed on the aligned
  block of that many consecutive ranks whose busiest member has the least ``s^2 / size``
  workload among blocks with room for ``s / size`` more tokens per member under the budget (with
  none, the block with most room). Sequences on the same block share one ring; no routing, no
  remapping.
"""

from __future__ import annotations

from typing import Iterator

from megatron_slim.plan.cp.assemble import GroupSpec, assemble
from megatron_slim.plan.cp.costs import CPCosts
from megatron_slim.plan.cp.layout import CPPlan, GroupKind
from megatron_slim.plan.cp.placement import check_lengths
from megatron_slim.plan.cp.topology import CPTopology
from megatron_slim.plan.schema import ConfigError


def _all(topo: CPTopology) -> tuple[int, ...]:
    return tuple(range(topo.num_ranks))


def _one_group(kind: GroupKind, lengths: tuple[int, ...], topo: CPTopology) -> list[GroupSpec]:
    """Every sequence in one group of ``kind`` over all ranks (``local`` on one rank)."""
    return [GroupSpec(kind if topo.num_ranks > 1 else "local", _all(topo), tuple(range(len(lengths))))]


def ring_specs(lengths: tuple[int, ...], topo: CPTopology) -> list[GroupSpec]:
    return _one_group("zigzag", lengths, topo)


def plan_ring(lengths: tuple[int, ...], topo: CPTopology) -> CPPlan:
    check_lengths(lengths)
    return assemble("ring", lengths, topo, ring_specs(lengths, topo))


def check_heads(engine: str, heads: int, ways: int, what: str) -> None:
    if heads % ways:
        raise ConfigError(
            f"--cp-engine {engine}: model.num_attention_heads={heads} (per TP rank) is not "
            f"divisible by {what}={ways} (allowed: engines ring, zeppelin, allgather, dynamic, "
            f"or a head count that {what} divides)"
        )


def ulysses_specs(lengths: tuple[int, ...], topo: CPTopology) -> list[GroupSpec]:
    return _one_group("ulysses", lengths, topo)


def plan_ulysses(lengths: tuple[int, ...], topo: CPTopology, costs: CPCosts) -> CPPlan:
    check_lengths(lengths)
    if topo.num_ranks > 1:
        check_heads("ulysses", costs.heads, topo.num_ranks, "parallel.cp")
    return assemble("ulysses", lengths, topo, ulysses_specs(lengths, topo))


def plan_a2a_p2p(lengths: tuple[int, ...], topo: CPTopology, costs: CPCosts) -> CPPlan:
    check_lengths(lengths)
    if topo.num_ranks > 1:
        check_heads("a2a+p2p", costs.heads, topo.ranks_per_node, "CP ranks per node")
    return assemble("a2a+p2p", lengths, topo, a2a_p2p_specs(lengths, topo))


def a2a_p2p_specs(lengths: tuple[int, ...], topo: CPTopology) -> list[GroupSpec]:
    m = topo.ranks_per_node
    seqs = tuple(range(len(lengths)))
    if topo.num_ranks == 1:
        spec = GroupSpec("local", (0,), seqs)
    elif m == 1:
        spec = GroupSpec("zigzag", _all(topo), seqs)
    elif topo.num_nodes == 1:
        spec = GroupSpec("ulysses", _all(topo), seqs)
    else:
        spec = GroupSpec("hierarchical", _all(topo), seqs, a2a_size=m)
    return [spec]


def allgather_specs(lengths: tuple[int, ...], topo: CPTopology) -> list[GroupSpec]:
    return _one_group("allgather", lengths, topo)


def plan_allgather(lengths: tuple[int, ...], topo: CPTopology) -> CPPlan:
    check_lengths(lengths)
    return assemble("allgather", lengths, topo, allgather_specs(lengths, topo))


def dynamic_size(s: int, budget: int, num_ranks: int) -> int:
    """``2^ceil(log2(s / budget))``, at least 1, at most the largest power of two dividing ``C``
    (the aligned blocks of one size must tile the ranks)."""
    cap = num_ranks & -num_ranks
    need = -(-s // budget)  # the least size with size * budget >= s
    return min(1 << (need - 1).bit_length(), cap)  # the least power of two >= need


def plan_dynamic(lengths: tuple[int, ...], topo: CPTopology) -> CPPlan:
    check_lengths(lengths)
    return assemble("dynamic", tuple(lengths), topo, dynamic_specs(tuple(lengths), topo))


def _block_max(values: list[float], size: int) -> list[float]:
    """``max(values[k * size : (k + 1) * size])`` for every aligned block ``k``."""
    if size == 1:
        return values
    return list(map(max, *(values[j::size] for j in range(size))))


def _dynamic_block(size: int, share: float, budget: int, work: list[float], tokens: list[float]) -> tuple[int, ...]:
    """The aligned block of ``size`` ranks whose busiest member has the least work among blocks
    with room for ``share`` more tokens per member (ties: the lowest); with none, the most room.
    A block's room is its fullest member's (``budget - t`` falls as ``t`` grows, so the minimum
    room is ``budget - max(t)`` exactly)."""
    starts = range(0, len(work), size)
    room = [budget - t for t in _block_max(tokens, size)]
    fitting = [k for k, x in enumerate(room) if x >= share]
    if fitting:
        busiest = _block_max(work, size)
        k = min(fitting, key=busiest.__getitem__)  # min keeps the first of equals
    else:
        k = room.index(max(room))
    return tuple(range(starts[k], starts[k] + size))


def dynamic_placements(lengths: tuple[int, ...], topo: CPTopology) -> Iterator[tuple[int, tuple[int, ...]]]:
    """Megatron dynamic CP's placement one sequence at a time, longest first: (sequence, its
    block of ranks). A consumer may stop early (``choose`` does once the engine cannot win)."""
    num_ranks = topo.num_ranks
    budget = -(-sum(lengths) // num_ranks)
    work = [0.0] * num_ranks
    tokens = [0.0] * num_ranks
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        s = lengths[i]
        size = dynamic_size(s, budget, num_ranks)
        share = s / size
        if size == 1:  # the common case, without building one-rank blocks
            fitting = [r for r, t in enumerate(tokens) if budget - t >= share]
            if fitting:
                r0 = min(fitting, key=work.__getitem__)
            else:
                room = [budget - t for t in tokens]
                r0 = room.index(max(room))
            block: tuple[int, ...] = (r0,)
        else:
            block = _dynamic_block(size, share, budget, work, tokens)
        for r in block:
            work[r] += s * s / size
            tokens[r] += share
        yield i, block


def dynamic_groups(blocks: dict[tuple[int, ...], list[int]]) -> list[GroupSpec]:
    """Sequences on the same block share one ring."""
    return [GroupSpec("zigzag" if len(b) > 1 else "local", b, tuple(seqs)) for b, seqs in blocks.items()]


def dynamic_specs(lengths: tuple[int, ...], topo: CPTopology) -> list[GroupSpec]:
    blocks: dict[tuple[int, ...], list[int]] = {}
    for i, block in dynamic_placements(lengths, topo):
        blocks.setdefault(block, []).append(i)
    return dynamic_groups(blocks)
