"""DP-merge in ``megatron-slim train``: a sample split over two DP replicas, and the order that runs it.

Shape (``merge_transfers``): a DP-merged sample has two pieces on two DP ranks, a *head* (its
tokens ``[0, prefix)``) and a *tail* (the rest), each whole in one window. The tail's queries
attend the head's keys, so at every attention layer:

* forward: the head rank, in the forward of its *send slice* (the slice holding the head's last
  row), sends the head rows' K and V to the tail rank, which receives them in the forward of its
  *receive slice* (the slice holding the tail's first row) and keeps them for its later slices;
* backward: the tail rank sums the dK/dV of those rows over its slices and sends them in the
  backward of its receive slice (the last to touch the tail: backward runs slices in reverse);
  the head rank receives them in the backward of its send slice (the first to touch the head),
  before the earlier head slices' backward reads their accumulated dK/dV.

Execution order that cannot deadlock (``check_merge_order``): sends are posted without waiting
(buffered until received) and only receives block, so a run is deadlock-free exactly when the
actions can be executed in some order that respects every rank's own order and, per transfer,
``F(send slice) before F(receive slice)`` and ``B(receive slice) before B(send slice)``. The check
walks every rank's schedule under those edges; an action waiting on one that can never run is a
deadlock (a cycle), refused with each stuck rank's next action and what it waits for. One action
that both sends and receives meets its peer only through whole actions here (no same-layer
rendezvous), so a pair of actions waiting on each other is refused too.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING, Protocol, Sequence

from megatron_slim.plan.pack.plan import PackingPlan, Piece
from megatron_slim.plan.schema import ConfigError

if TYPE_CHECKING:
    from megatron_slim.plan.recipe import Recipe


class _Window(Protocol):
    @property
    def pieces(self) -> tuple[Piece, ...]: ...


@dataclass(frozen=True)
class MergeEnd:
    """Rows ``[row, row + length)`` of window ``window`` of DP rank ``rank``."""

    rank: int
    window: int
    row: int
    length: int

    def slice_at(self, slice_lengths: Sequence[int], last: bool) -> int:
        """The slice holding this end's first row (``last``: its last row)."""
        row = self.row + self.length - 1 if last else self.row
        ends = list(accumulate(slice_lengths))
        return next(j for j, end in enumerate(ends) if row < end)


@dataclass(frozen=True)
class MergeTransfer:
    sample: int
    head: MergeEnd  # the sample's tokens [0, prefix)
    tail: MergeEnd  # the rest, attending to the head's K/V

    @property
    def prefix(self) -> int:
        return self.head.length


def merge_runs(recipe: "Recipe") -> bool:
    """``megatron-slim train`` runs DP-merge (and so SlimPack is offered it): slimpack packing over
    dp > 1 replicas of pp=1 SlimPipe, without tp, cp, the context-exchange slice policy, recomputation,
    offloading or DynMo's dynamic layers (each would add layers or messages these transfers do not
    follow); everywhere else the planner keeps DP-merge off."""
    from megatron_slim.plan.dynmo.options import DynmoConfig

    p, t, d = recipe.parallel, recipe.train, recipe.dynmo
    plain_layers = d == DynmoConfig(profile=d.profile, profile_smoothing=d.profile_smoothing)
    return (
        recipe.data.packing == "slimpack"
        and recipe.schedule.kind == "slimpipe"
        and recipe.schedule.slice_policy != "exchange"
        and p.dp > 1
        and (p.pp, p.vpp, p.tp, p.cp) == (1, 1, 1, 1)
        and t.recompute == "none"
        and t.offload_ratio == 0.0
        and plain_layers
    )


Step = tuple[str, int, int]  # ("F" | "B", microbatch, slice): one compute action of a rank
Node = tuple[int, Step]  # (DP rank, action)


def _place_pieces(windows: Sequence[Sequence[_Window]]) -> dict[int, list[tuple[Piece, MergeEnd]]]:
    where: dict[int, list[tuple[Piece, MergeEnd]]] = {}
    for r, rank_windows in enumerate(windows):
        for m, w in enumerate(rank_windows):
            row = 0
            for p in w.pieces:
                where.setdefault(p.sample, []).append((p, MergeEnd(r, m, row, p.length)))
                row += p.length
    return where


def merge_transfers(plan: PackingPlan, windows: Sequence[Sequence[_Window]]) -> tuple[MergeTransfer, ...]:
    """The plan's samples spread over DP ranks, as head/tail transfers (by sample); refused unless
    each is two pieces on two DP ranks."""
    out = []
    for sample, placed in sorted(_place_pieces(windows).items()):
        if len({end.rank for _, end in placed}) < 2:
            continue
        placed.sort(key=lambda pe: pe[0].start)
        if len(placed) != 2:
            where = [(end.rank, end.window) for _, end in placed]
            raise ConfigError(
                f"data.packing={plan.method}: DP-merged sample {sample} has {len(placed)} pieces at (rank, window) "
                f"{where}; allowed: two pieces on two DP ranks (head and tail)"
            )
        (_, head), (_, tail) = placed
        out.append(MergeTransfer(sample, head, tail))
    return tuple(out)


def _dependencies(transfers: Sequence[MergeTransfer], slice_lengths: Sequence[int]) -> dict[Node, list[Node]]:
    """(rank, action) -> the (rank, action)s that must run before it."""
    needs: dict[Node, list[Node]] = {}
    for t in transfers:
        send = t.head.slice_at(slice_lengths, last=True)
        receive = t.tail.slice_at(slice_lengths, last=False)
        head_f, head_b = (t.head.rank, ("F", t.head.window, send)), (t.head.rank, ("B", t.head.window, send))
        tail_f, tail_b = (t.tail.rank, ("F", t.tail.window, receive)), (t.tail.rank, ("B", t.tail.window, receive))
        needs.setdefault(tail_f, []).append(head_f)
        needs.setdefault(head_b, []).append(tail_b)
    return needs


def check_merge_order(
    transfers: Sequence[MergeTransfer], orders: Sequence[Sequence[Step]], slice_lengths: Sequence[int]
) -> None:
    """Refuse (``ConfigError``) an order in which some transfer's receive can never be served."""
    needs = _dependencies(transfers, slice_lengths)
    for (rank, step), wanted in needs.items():
        for other in [(rank, step), *wanted]:
            if other[1] not in orders[other[0]]:
                raise ConfigError(f"DP-merge order: rank {other[0]} runs no action {_name(other[1])}")
    done: set[tuple[int, Step]] = set()
    at = [0] * len(orders)
    progress = True
    while progress:
        progress = False
        for r, order in enumerate(orders):
            while at[r] < len(order) and all(w in done for w in needs.get((r, order[at[r]]), ())):
                done.add((r, order[at[r]]))
                at[r] += 1
                progress = True
    stuck = [r for r, order in enumerate(orders) if at[r] < len(order)]
    if stuck:
        lines = []
        for r in stuck:
            step = orders[r][at[r]]
            waits = [f"rank {w[0]} {_name(w[1])}" for w in needs.get((r, step), ()) if w not in done]
            lines.append(f"  rank {r}: {_name(step)} waits for {', '.join(waits)}")
        raise ConfigError(
            "DP-merge order deadlocks (allowed: orders in which every K/V receive follows its send):\n"
            + "\n".join(lines)
        )


def _name(step: Step) -> str:
    return f"{step[0]}{step[1]}.{step[2]}"
