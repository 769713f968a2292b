"""Discrete-event simulation of a pipeline schedule under a cost model.

Per rank: one compute stream that runs the rank's compute actions in schedule order, and a send
stream; an action starts once the readiness rules the validator shares (``schedule/walk.py``)
allow it, at the latest time among what it waits for. A ``SEND`` starts when its data is computed
and the directed link is free, occupies the link for ``bytes / bandwidth`` and arrives ``latency``
later; a ``RECV`` holds the rank's compute stream until the data has arrived (as the runtime's wait does).
A receive's buffer is held from where ``schedule/recv_posts.py`` posts it (a compute's start, else
when the rank reaches it); the sender's is free once the data has arrived and the receive is posted.
A ``SEND`` that waits for its link's send window (``schedule/walk.py``) holds the compute stream
too, as the runtime's wait for its oldest send does.

Memory per rank, over time:
* activations: saved by ``F`` when it ends, released when the matching ``B`` (or ``W``) ends;
* K/V: the cache a slice's ``F`` leaves behind, released by its ``B``/``I``; plus the dK/dV
  accumulation buffers of the earlier slices, allocated when a microbatch's last slice starts its
  backward and released chunk by chunk as each slice's backward consumes them;
* in-flight messages (p2p): a sent slice's buffer from its ``SEND`` until its transfer completes
  (the transfer needs both ends); a received buffer from the receive's posting (ahead of its
  ``RECV``) until the compute that consumes it starts (from there it is that compute's
  input, priced as its activations);
* static: weights, gradients and optimizer state, constant.

Context exchange (``Schedule.exchange``, ``schedule/exchange_blocks.py``): the compute actions
linked by blocks (a group) start together in the readiness walk, each at its own rank's ready
time. A block's attention time (``block``, priced in its sender's pass) leaves the sender's
duration and joins its taker's. A taker computes its blocks one after another in plan order, each
as soon as the sender's Q and K/V have crossed (``over``) and the previous block is done; a
sender cannot finish before each block's result is back (``back``):

    block end  = max(previous block end (first: taker start), sender start + over) + block
    taker end  = max(taker start + own work + its blocks, last block end)
    sender end = max(sender start + own work - its blocks, every block end + back)

with ``over``/``back`` the block's bytes over the PP link between the two ranks plus one latency a
layer each way. A single block is the mirrored pair of earlier versions. Transfers run beside
compute and do not occupy the pipeline's activation links (contention there is not modelled);
busy time counts work only, not the sender's wait. A taker holds one layer's K/V of each of its
blocks (backward: with their dK/dV) from its start to its end, counted as K/V.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, cast

from megatron_slim.plan.progress import Progress
from megatron_slim.plan.schedule.exchange_blocks import ExchangePlan
from megatron_slim.plan.schedule.ir import Action, Kind, Schedule
from megatron_slim.plan.schedule.lower import lower
from megatron_slim.plan.schedule.recv_posts import posted_before
from megatron_slim.plan.schedule.validate import validate
from megatron_slim.plan.schedule.walk import Walker
from megatron_slim.plan.sim.costs import ExchangeCosts, PipelineCosts
from megatron_slim.plan.sim.in_flight import InFlight, MemoryDelta


@dataclass(frozen=True)
class Event:
    rank: int
    stream: str  # "compute" | "send" | "recv"
    name: str  # the IR action string
    start: float
    end: float
    stage: int
    microbatch: int
    slice: int


@dataclass
class RankResult:
    rank: int
    stages: tuple[int, ...]
    static_bytes: float
    busy_s: float = 0.0
    peak_memory_bytes: float = 0.0
    peak_activation_bytes: float = 0.0
    peak_kv_bytes: float = 0.0
    peak_p2p_bytes: float = 0.0  # in-flight send and receive buffers
    peak_recv_bytes: float = 0.0  # the receive buffers among them
    memory: list[tuple[float, float, float]] = field(default_factory=list)  # (time, activation, kv)

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "stage": self.rank,
            "stages": list(self.stages),
            "peak_memory_bytes": int(self.peak_memory_bytes),
            "peak_activation_bytes": int(self.peak_activation_bytes),
            "peak_kv_bytes": int(self.peak_kv_bytes),
            "peak_p2p_bytes": int(self.peak_p2p_bytes),
            "static_bytes": int(self.static_bytes),
            "busy_s": self.busy_s,
        }


@dataclass
class SimResult:
    schedule: Schedule
    pipeline_time_s: float
    iteration_time_s: float
    bubble_ratio: float
    mfu: float
    hbm_bytes: float
    ranks: list[RankResult]
    events: list[Event]

    def to_json(self) -> dict[str, Any]:
        peak = max(r.peak_memory_bytes for r in self.ranks)
        return {
            "schedule": self.schedule.kind,
            "pp": self.schedule.pp,
            "vpp": self.schedule.vpp,
            "num_microbatches": self.schedule.num_microbatches,
            "num_slices": self.schedule.num_slices,
            "iteration_time_s": self.iteration_time_s,
            "pipeline_time_s": self.pipeline_time_s,
            "bubble_ratio": self.bubble_ratio,
            "mfu": self.mfu,
            "peak_memory_bytes": int(peak),
            "hbm_bytes": int(self.hbm_bytes),
            "fits_in_memory": peak <= self.hbm_bytes,
            "schedule_digest": self.schedule.digest(),
            "ranks": [r.to_json() for r in self.ranks],
        }


def compute_time(costs: PipelineCosts, stage: int, a: Action) -> float:
    """How long compute action ``a`` of ``stage`` takes, unpaired."""
    mb, j = a.microbatch, a.slice
    if a.kind is Kind.F:
        return costs.forward(stage, mb, j)
    if a.kind is Kind.B:
        return costs.backward(stage, mb, j)
    if a.kind is Kind.W:
        return costs.weight_grad(stage, mb, j)
    return costs.backward(stage, mb, j) - costs.weight_grad(stage, mb, j)


class _Run:
    def __init__(self, schedule: Schedule, costs: PipelineCosts) -> None:
        self.schedule = schedule
        self.costs = costs
        self.free = [0.0] * schedule.pp  # compute stream
        self.link_free: dict[tuple[int, int], float] = {}
        self.events: list[Event] = []
        self.mem: list[list[MemoryDelta]] = [[] for _ in range(schedule.pp)]
        self.busy = [0.0] * schedule.pp
        self.exchange = ExchangePlan.from_text(schedule.exchange)
        self.p2p = InFlight(schedule, self.mem)  # one list per rank: ties keep the order of events
        self.posted_before = [posted_before(schedule, r) for r in range(schedule.pp)]
        self.started: dict[tuple[int, Action], float] = {}  # (rank, compute) -> start: receives posted there

    def _step(self, rank: int, a: Action, ready: float) -> float:
        """Run ``a`` no earlier than ``ready``; the time its result is available (a SEND's: arrival)."""
        if a.kind.is_compute:
            return self._compute(rank, a, ready)
        if a.kind in (Kind.SEND_F, Kind.SEND_B):
            return self._send(rank, a, ready)
        return self._recv(rank, a, ready)

    def _duration(self, stage: int, a: Action) -> float:
        return compute_time(self.costs, stage, a)

    def _compute(self, rank: int, a: Action, ready: float) -> float:
        stage = self.schedule.stage(rank, a.chunk)
        start = max(self.free[rank], ready)
        dur = self._duration(stage, a)
        return self._record(rank, a, start, start + dur, dur)

    def _record(self, rank: int, a: Action, start: float, end: float, busy: float) -> float:
        stage = self.schedule.stage(rank, a.chunk)
        self.p2p.consumed(rank, a, start)
        self.started[(rank, a)] = start
        self.free[rank] = end
        self.busy[rank] += busy
        self.events.append(Event(rank, "compute", str(a), start, end, stage, a.microbatch, a.slice))
        self._account_memory(rank, a, stage, start, end)
        return end

    def _group(self, members: list[tuple[int, Action, float]]) -> list[float]:
        """A context-exchange group (see the module docstring); each member's end, in order."""
        costs = cast(ExchangeCosts, self.costs)
        start = {(r, a): max(self.free[r], ready) for r, a, ready in members}
        own = {(r, a): self._duration(self.schedule.stage(r, a.chunk), a) for r, a, _ in members}
        end = dict(start)
        cursor = dict(start)
        held: dict[tuple[int, Action], float] = {}
        for b in self.exchange.blocks_among(start):
            a = b.sender_action
            work = costs.exchange(self.schedule.stage(b.sender, a.chunk), a.microbatch, a.slice, b.tokens, b.backward)
            link = self.costs.link(b.sender, b.taker)
            over = work.out_bytes / link.bandwidth + work.messages * link.latency
            back = work.back_bytes / link.bandwidth + work.messages * link.latency
            own[b.sender_end] -= work.block_s
            own[b.taker_end] += work.block_s
            cursor[b.taker_end] = max(cursor[b.taker_end], start[b.sender_end] + over) + work.block_s
            end[b.sender_end] = max(end[b.sender_end], cursor[b.taker_end] + back)
            end[b.taker_end] = max(end[b.taker_end], cursor[b.taker_end])
            held[b.taker_end] = held.get(b.taker_end, 0.0) + work.peer_bytes
        out = []
        for r, a, _ in members:
            ra = (r, a)
            finish = max(end[ra], start[ra] + own[ra])
            if ra in held:
                self.mem[r] += [(start[ra], 0.0, held[ra]), (finish, 0.0, -held[ra])]
            out.append(self._record(r, a, start[ra], finish, own[ra]))
        return out

    def _account_memory(self, rank: int, a: Action, stage: int, start: float, end: float) -> None:
        mb, j, costs, n = a.microbatch, a.slice, self.costs, self.schedule.num_slices
        mem = self.mem[rank]
        if a.kind is Kind.F:
            mem.append((end, costs.activation_bytes(stage, mb, j), costs.kv_bytes(stage, mb, j)))
            return
        if a.kind in (Kind.B, Kind.I):
            transient = costs.backward_transient_bytes(stage, mb, j)  # recompute working set, prefetch
            if transient:
                mem += [(start, transient, 0.0), (end, -transient, 0.0)]
            if j == n - 1 and n > 1:
                buffers = sum(costs.kv_grad_bytes(stage, mb, i) for i in range(n - 1))
                mem.append((start, 0.0, buffers))
            freed_kv = costs.kv_bytes(stage, mb, j) + (costs.kv_grad_bytes(stage, mb, j) if j < n - 1 else 0.0)
            freed_act = costs.activation_bytes(stage, mb, j) if a.kind is Kind.B else 0.0
            mem.append((end, -freed_act, -freed_kv))
        elif a.kind is Kind.W:
            mem.append((end, -costs.activation_bytes(stage, mb, j), 0.0))

    def _send(self, rank: int, a: Action, ready: float) -> float:
        stage = self.schedule.stage(rank, a.chunk)
        forward = a.kind is Kind.SEND_F
        dst_stage = stage + 1 if forward else stage - 1
        dst = self.schedule.placement(dst_stage)[0]
        link = self.costs.link(rank, dst)
        nbytes = self.costs.p2p_bytes(stage if forward else dst_stage, a.microbatch, a.slice)
        self.started[(rank, a)] = self.free[rank]  # receives posted at this point are held from here
        self.free[rank] = max(self.free[rank], ready)  # a send window's wait holds the compute stream
        self.p2p.sent(rank, a, nbytes, ready)
        start = max(ready, self.link_free.get((rank, dst), 0.0))
        done = start + nbytes / link.bandwidth
        self.link_free[(rank, dst)] = done
        arrival = done + link.latency
        self.events.append(Event(rank, "send", str(a), start, arrival, stage, a.microbatch, a.slice))
        return arrival

    def _recv(self, rank: int, a: Action, arrival: float) -> float:
        self.started.setdefault((rank, a), self.free[rank])
        at = self.posted_before[rank][a]
        post = self.started.get((rank, at), self.free[rank])
        self.p2p.posted(rank, a, post, max(arrival, post), ahead=not at.kind.is_compute)
        if arrival > self.free[rank]:
            stage = self.schedule.stage(rank, a.chunk)
            self.events.append(Event(rank, "recv", str(a), self.free[rank], arrival, stage, a.microbatch, a.slice))
            self.free[rank] = arrival
        return self.free[rank]

    def run(self, progress: Optional[Progress] = None) -> None:
        if Walker(self.schedule).run(self._step, progress, "simulating", self._group):
            raise RuntimeError("simulation stalled on a schedule the validator accepted")  # invariant


def _memory_peaks(result: RankResult, deltas: list[MemoryDelta]) -> None:
    act = kv = sent = received = 0.0
    timeline = [(0.0, 0.0, 0.0)]
    for d in sorted(deltas, key=lambda d: (d[0], d[5] if len(d) > 5 else 0.0)):  # stable: an instant keeps its order
        t, da, dk, ds, dr = (d + (0.0, 0.0))[:5]
        act, kv, sent, received = act + da, kv + dk, sent + ds, received + dr
        if da or dk:
            timeline.append((t, act, kv))
        result.peak_activation_bytes = max(result.peak_activation_bytes, act)
        result.peak_kv_bytes = max(result.peak_kv_bytes, kv)
        result.peak_p2p_bytes = max(result.peak_p2p_bytes, sent + received)
        result.peak_recv_bytes = max(result.peak_recv_bytes, received)
        result.peak_memory_bytes = max(result.peak_memory_bytes, act + kv + sent + received)
    result.peak_memory_bytes += result.static_bytes
    result.memory = timeline


def simulate(schedule: Schedule, costs: PipelineCosts, progress: Optional[Progress] = None) -> SimResult:
    """Simulate ``schedule`` (compute-only schedules are lowered first) and summarise it.
    ``progress(phase, done, total)``: the lowering's, the validator's, then ``simulating`` (actions)."""
    lowered = schedule if schedule.is_lowered else lower(schedule, progress)
    validate(lowered, progress)
    if lowered.exchange and not hasattr(costs, "exchange"):
        raise TypeError(f"{type(costs).__name__} cannot price context exchange: it has no exchange() (ExchangeCosts)")
    run = _Run(lowered, costs)
    run.run(progress)
    pipeline_time = max(run.free + [e.end for e in run.events] + [0.0])
    ranks = []
    for r in range(schedule.pp):
        res = RankResult(
            r, tuple(schedule.stage(r, c) for c in range(schedule.vpp)), costs.static_bytes(r), busy_s=run.busy[r]
        )
        _memory_peaks(res, run.mem[r])
        ranks.append(res)
    iteration = pipeline_time + max(costs.after_pipeline(r) for r in range(schedule.pp))
    bubble = 1.0 - sum(run.busy) / (schedule.pp * pipeline_time) if pipeline_time > 0 else 0.0
    mfu = costs.model_flops() / (iteration * schedule.pp * costs.peak_flops()) if iteration > 0 else 0.0
    events = sorted(run.events, key=lambda e: (e.rank, e.start))
    return SimResult(lowered, pipeline_time, iteration, bubble, mfu, costs.hbm_bytes(), ranks, events)
