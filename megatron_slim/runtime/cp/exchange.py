"""One communication step of the engine: a set of hops posted together, routed or direct.

A ``Hop`` moves a ``[rows, width]`` message from CP rank ``src`` to ``dst`` (a ring step's K/V
block, one pair of an all-to-all). A routed hop (parts from the plan's ``RoutingPlan``) is carried
in legs, exactly as the routing layer describes it: part ``p`` goes ``src -> proxy_src`` over
NVLink (dispatch), ``proxy_src -> proxy_dst`` over that proxy's NIC, ``proxy_dst -> dst`` over
NVLink (combine); a leg whose ends coincide is skipped.

Posting runs in three stages on every rank the exchange involves (senders, proxies, receivers):

1. receives for stage-1 legs, then sends of every leg that starts at the message's source;
2. receives for stage-2 legs, then each NIC leg from a proxy: wait for its dispatch, forward;
3. receives for stage-3 legs, then each combine leg: wait for its NIC part, forward.

A stage waits only on legs of earlier stages, and every rank posts the legs of a stage in one
canonical order (hop, part), so both ends of a directed pair agree on message order without tags
and no wait can close a cycle. The destination's receives are waited on later, in ``Pending.wait``,
so communication overlaps whatever the caller computes in between.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from megatron_slim.plan.cp.routing import RoutePart
from megatron_slim.runtime.cp.comm import Comm

Tensor = torch.Tensor


@dataclass(frozen=True)
class Hop:
    src: int
    dst: int
    rows: int
    width: int
    parts: tuple[RoutePart, ...] = ()  # routed: rows [start, end) of each part and its proxies

    @property
    def routed(self) -> bool:
        return bool(self.parts)


@dataclass(frozen=True)
class Leg:
    hop: int
    part: int
    stage: int
    sender: int
    receiver: int
    start: int
    end: int
    from_source: bool  # the sender is the hop's source (else it forwards a relayed part)
    to_destination: bool  # the receiver is the hop's destination (else it relays the part on)


def _legs(index: int, hop: Hop) -> list[Leg]:
    if hop.rows == 0 or hop.src == hop.dst:
        return []
    if not hop.parts:
        return [Leg(index, 0, 1, hop.src, hop.dst, 0, hop.rows, True, True)]
    covered = sorted((p.start, p.end) for p in hop.parts)
    if covered[0][0] != 0 or covered[-1][1] != hop.rows or any(a[1] != b[0] for a, b in zip(covered, covered[1:])):
        raise ValueError(
            f"route of hop {hop.src}->{hop.dst} ({hop.rows} rows): parts {covered} do not tile the "
            "message; the routing plan does not match the CP plan"
        )
    legs = []
    for p_i, p in enumerate(hop.parts):
        chain = [hop.src] + [r for r in (p.proxy_src, p.proxy_dst) if r not in (hop.src, hop.dst)] + [hop.dst]
        chain = [r for i, r in enumerate(chain) if i == 0 or r != chain[i - 1]]
        for stage, (a, b) in enumerate(zip(chain, chain[1:]), start=1):
            legs.append(Leg(index, p_i, stage, a, b, p.start, p.end, a == hop.src, b == hop.dst))
    return legs


class Exchange:
    """A static description (built once per plan); ``post`` runs it on one rank."""

    def __init__(self, name: str, hops: tuple[Hop, ...]) -> None:
        self.name = name
        self.hops = tuple(hops)
        legs = [leg for i, hop in enumerate(self.hops) for leg in _legs(i, hop)]
        self.legs = tuple(sorted(legs, key=lambda leg: (leg.stage, leg.hop, leg.part)))
        self._mine: dict[int, tuple[tuple[list[Leg], list[Leg]], ...]] = {}

    def involves(self, rank: int) -> bool:
        return any(rank in (h.src, h.dst) for h in self.hops if h.rows) or any(
            rank in (leg.sender, leg.receiver) for leg in self.legs
        )

    def legs_of(self, rank: int) -> tuple[tuple[list[Leg], list[Leg]], ...]:
        """Per stage 1..3: (legs ``rank`` receives, legs it sends), in canonical order."""
        if rank not in self._mine:
            self._mine[rank] = tuple(
                (
                    [leg for leg in self.legs if leg.stage == s and leg.receiver == rank],
                    [leg for leg in self.legs if leg.stage == s and leg.sender == rank],
                )
                for s in (1, 2, 3)
            )
        return self._mine[rank]

    def post(
        self, comm: Comm, payloads: Mapping[int, Tensor], *, dtype: torch.dtype, device: torch.device
    ) -> "Pending":
        """Post this rank's part of the exchange. ``payloads[i]``: the ``[rows, width]`` message of
        hop ``i`` for every hop this rank sends; returns what it will receive."""
        me = comm.me
        outputs: dict[int, Tensor] = {}
        for i, hop in enumerate(self.hops):
            if hop.src == me:
                _check_payload(self.name, i, hop, payloads.get(i))
            if hop.dst == me:
                outputs[i] = (
                    payloads[i] if hop.src == me else torch.empty(hop.rows, hop.width, dtype=dtype, device=device)
                )
        finals = []
        relayed: dict[tuple[int, int], tuple[Tensor, Any]] = {}
        for receives, sends in self.legs_of(me):
            for leg in receives:
                if leg.to_destination:
                    finals.append(comm.recv(outputs[leg.hop][leg.start : leg.end], leg.sender))
                else:
                    buffer = torch.empty(leg.end - leg.start, self.hops[leg.hop].width, dtype=dtype, device=device)
                    relayed[(leg.hop, leg.part)] = (buffer, comm.recv(buffer, leg.sender))
            for leg in sends:
                if leg.from_source:
                    data = payloads[leg.hop][leg.start : leg.end]
                else:
                    data, work = relayed.pop((leg.hop, leg.part))
                    work.wait()
                comm.send(data, leg.receiver)
            comm.flush()  # one stage's receives and sends: one batch (runtime/cp/comm.py)
        return Pending(outputs, finals)


def _check_payload(name: str, index: int, hop: Hop, payload: Tensor | None) -> None:
    if payload is None:
        raise ValueError(f"{name}: hop {index} ({hop.src}->{hop.dst}) has no payload")
    if tuple(payload.shape) != (hop.rows, hop.width) or not payload.is_contiguous():
        raise ValueError(
            f"{name}: hop {index} ({hop.src}->{hop.dst}) expects a contiguous [{hop.rows}, "
            f"{hop.width}] payload, got {tuple(payload.shape)}"
        )


class Pending:
    """What one rank receives from an exchange, once ``wait`` returns: hop index -> message."""

    def __init__(self, outputs: dict[int, Tensor], works: list) -> None:
        self._outputs = outputs
        self._works = works

    def wait(self) -> dict[int, Tensor]:
        for work in self._works:
            work.wait()
        self._works = []
        return self._outputs
