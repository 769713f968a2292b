"""``PipelineCosts`` of one DP rank of a packing plan: each MicroPack is a microbatch.

A MicroPack's pieces run back to back as one packed (THD) sequence. With ``num_slices > 1`` the
packed sequence is cut into that many slices of (near) equal tokens -- a slice may hold the tail of
one document and the head of the next; a microbatch with fewer tokens than slices leaves the last
slices empty (free). Uniform token slices, not the recipe's balanced policy: balanced slices are
defined on one sequence of ``model.seq_length`` tokens, a MicroPack holds many documents.

A slice's time is the cost model's time of each of its pieces at its prefix (its start within its
document: documents do not attend across each other), less the per-call fixed part (per-layer
communication latency) counted once per slice rather than once per piece, since the slice's
kernels and collectives run once over all its tokens. That fixed part is read off the cost model
as ``3 f(1) - 3 f(2) + f(3)``, exact for a time ``c + a n + k n (n + 1) / 2`` in ``n`` tokens.

Memory per slice follows its token count, as for an unpacked slice. A piece whose document began
in an earlier MicroPack (or on another DP rank) also holds that prefix's K/V from its forward to
its backward; a piece of a document spread over DP ranks pays for receiving that prefix K/V in
forward and returning dK/dV in backward (as ``assemble.price`` does). Both are charged to the slice
holding the piece's first token. A piece of a CP-routed outlier (``PackingPlan.routes``) runs split
over the CP group by Zeppelin's placement: its times are scaled by ``routed_scales`` (the CP
route's price of the whole document over the cost model's, forward apart from backward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from megatron_slim.plan.cost.model import CostModel, Link
from megatron_slim.plan.pack.cp_route import CPRoute
from megatron_slim.plan.pack.plan import MicroPack, PackingPlan, Piece
from megatron_slim.plan.sim.costs import CostModelTerms

TimeFn = Callable[[int, float, float], float]


@dataclass(frozen=True)
class PackedSlice:
    pieces: tuple[Piece, ...]  # sub-pieces with their document offsets
    external_prefix: float  # K/V tokens held from outside this microbatch
    received_prefix: float  # K/V tokens received from other DP ranks

    @property
    def tokens(self) -> int:
        return sum(p.length for p in self.pieces)


def cut_micropack(pack: MicroPack, num_slices: int, spread: frozenset[int] = frozenset()) -> tuple[PackedSlice, ...]:
    """``pack``'s packed sequence in ``num_slices`` slices of near-equal tokens (see module doc)."""
    total = pack.tokens
    bounds = [round(j * total / num_slices) for j in range(num_slices + 1)]
    slices: list[list[Piece]] = [[] for _ in range(num_slices)]
    external = [0.0] * num_slices
    received = [0.0] * num_slices
    seen: set[int] = set()
    offset = 0
    j = 0
    for p in pack.pieces:
        while bounds[j + 1] <= offset:
            j += 1
        if p.sample not in seen and p.start > 0:
            external[j] += p.start
        if p.sample in spread:
            received[j] += p.start
        seen.add(p.sample)
        done = 0
        while done < p.length:
            while bounds[j + 1] <= offset + done:
                j += 1
            n = min(p.length - done, bounds[j + 1] - offset - done)
            slices[j].append(Piece(p.sample, p.start + done, n))
            done += n
        offset += p.length
    return tuple(PackedSlice(tuple(s), e, r) for s, e, r in zip(slices, external, received))


def routed_scales(plan: PackingPlan, cost: CostModel) -> dict[int, tuple[float, float]]:
    """Per CP-routed sample: (forward, backward) of its CP route over the cost model's time of the
    whole document, both on the stage the plan was priced at (``cp_route.CPRoute.from_cost_model``)."""
    routed = plan.cp_routed()
    if not routed:
        return {}
    route = CPRoute.from_cost_model(cost, plan.token_cap)
    stage = min(1, cost.num_stages - 1)
    out = {}
    for sample in sorted(routed):
        n = plan.sample_lengths[sample]
        fwd, bwd = route.sample_work(n)
        out[sample] = (fwd / cost.forward_time(stage, n, 0.0), bwd / cost.backward_time(stage, n, 0.0))
    return out


class PackedCosts(CostModelTerms):
    """What the simulator asks, for the MicroPacks ``packs`` of one DP rank (``PipelineCosts``).

    ``model_flops_total``: the model FLOPs this rank's share of the batch stands for (the MFU
    numerator, decided by the caller); ``kv_link``: the link prefix K/V crosses between DP ranks;
    ``scales``: CP-routed samples' time factors (``routed_scales``)."""

    def __init__(
        self,
        cost: CostModel,
        packs: Sequence[MicroPack],
        num_slices: int,
        spread: frozenset[int] = frozenset(),
        model_flops_total: float = 0.0,
        kv_link: Link | None = None,
        scales: Mapping[int, tuple[float, float]] | None = None,
    ) -> None:
        self.cost = cost
        self.slices = [cut_micropack(m, num_slices, spread) for m in packs]
        self._model_flops = model_flops_total
        p = cost.recipe.parallel
        self.kv_link = kv_link or cost.link(cost.gpu_index(), cost.gpu_index(dp=min(1, p.dp - 1)))
        self._fixed: dict[tuple[str, int], float] = {}
        self.scales = scales or {}

    def _fixed_part(self, name: str, fn: TimeFn, stage: int) -> float:
        key = (name, stage)
        if key not in self._fixed:
            self._fixed[key] = max(0.0, 3 * fn(stage, 1, 0) - 3 * fn(stage, 2, 0) + fn(stage, 3, 0))
        return self._fixed[key]

    def _packed_time(self, name: str, fn: TimeFn, stage: int, s: PackedSlice) -> float:
        if not s.pieces:
            return 0.0
        if self.scales:
            pick = 0 if name == "f" else 1
            total = sum(fn(stage, p.length, p.start) * self.scales.get(p.sample, (1.0, 1.0))[pick] for p in s.pieces)
        else:
            total = sum(fn(stage, p.length, p.start) for p in s.pieces)
        return total - (len(s.pieces) - 1) * self._fixed_part(name, fn, stage)

    def _transfer(self, stage: int, s: PackedSlice) -> float:
        if not s.received_prefix:
            return 0.0
        return self.cost.kv_bytes(stage, 1.0) * s.received_prefix / self.kv_link.bandwidth

    def forward(self, stage: int, microbatch: int, slice_: int) -> float:
        s = self.slices[microbatch][slice_]
        return self._packed_time("f", self.cost.forward_time, stage, s) + self._transfer(stage, s)

    def backward(self, stage: int, microbatch: int, slice_: int) -> float:
        s = self.slices[microbatch][slice_]
        return self._packed_time("b", self.cost.backward_time, stage, s) + 2 * self._transfer(stage, s)

    def weight_grad(self, stage: int, microbatch: int, slice_: int) -> float:
        s = self.slices[microbatch][slice_]
        return self._packed_time("w", self.cost.weight_grad_time, stage, s)

    def _tokens(self, microbatch: int, slice_: int) -> int:
        return self.slices[microbatch][slice_].tokens

    def activation_bytes(self, stage: int, microbatch: int, slice_: int) -> float:
        return self.cost.activation_bytes(stage, self._tokens(microbatch, slice_))

    def backward_transient_bytes(self, stage: int, microbatch: int, slice_: int) -> float:
        return self.cost.backward_transient_bytes(stage, self._tokens(microbatch, slice_))

    def kv_bytes(self, stage: int, microbatch: int, slice_: int) -> float:
        s = self.slices[microbatch][slice_]
        held = self.cost.shape.kv_bytes(s.external_prefix) * self.cost.layers_per_stage
        return self.cost.kv_bytes(stage, s.tokens) + held

    def kv_grad_bytes(self, stage: int, microbatch: int, slice_: int) -> float:
        return self.cost.kv_grad_bytes(stage, self._tokens(microbatch, slice_))

    def p2p_bytes(self, stage: int, microbatch: int, slice_: int) -> float:
        return self.cost.p2p_bytes(self._tokens(microbatch, slice_))

    def model_flops(self) -> float:
        return self._model_flops
