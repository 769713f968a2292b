"""Check a schedule before anything runs it: completeness, dependency order, deadlock freedom.

Execution model (the runtime's): each rank runs its actions in order, each once it is ready by
the rules the simulator shares (``walk.py``): a compute action waits for its dependencies
(``deps.py``); ``SEND`` never blocks; ``RECV`` blocks until the matching ``SEND`` has been
issued. On failure, ``ScheduleError`` carries a rank x step grid with the offending actions marked.
"""

from __future__ import annotations

from collections import Counter
from typing import Optional

from megatron_slim.plan.progress import Progress, report
from megatron_slim.plan.schedule.ir import Action, Kind, Schedule
from megatron_slim.plan.schedule.walk import Walker, describe

# (direction, receiving stage, microbatch, slice) of one message; (rank, action) of one unit of work
CommKey = tuple[str, int, int, int]
Unit = tuple[int, Action]


class ScheduleError(ValueError):
    def __init__(self, message: str, grid: str = "") -> None:
        super().__init__(f"{message}\n{grid}" if grid else message)
        self.grid = grid


def format_grid(schedule: Schedule, marks: dict[int, int] | None = None, width: int = 12) -> str:
    """Rows are ranks, columns are steps; ``marks`` maps rank -> step to flag with ``>…<``.

    Long schedules show a window of ``width`` steps around the first mark.
    """
    marks = marks or {}
    length = max((len(r) for r in schedule.ranks), default=0)
    first = min(marks.values()) if marks else 0
    lo = max(0, first - width // 2)
    hi = min(length, lo + width)
    cells = []
    for rank, row in enumerate(schedule.ranks):
        line = []
        for step in range(lo, hi):
            text = str(row[step]) if step < len(row) else ""
            line.append(f">{text}<" if marks.get(rank) == step else text)
        cells.append(line)
    col = max([len(c) for line in cells for c in line] + [len(str(hi)), 4]) + 1
    header = "step    " + "".join(f"{s:<{col}}" for s in range(lo, hi))
    body = [f"rank {r:<3}" + "".join(f"{c:<{col}}" for c in line) for r, line in enumerate(cells)]
    more = f"  (steps {lo}..{hi - 1} of {length})" if (lo, hi) != (0, length) else ""
    return "\n".join([header + more, *body])


def _expected_units(schedule: Schedule) -> Counter[Unit]:
    expected: Counter[Unit] = Counter()
    split = schedule.has_split_backward
    backward_kinds = () if schedule.forward_only else (Kind.I, Kind.W) if split else (Kind.B,)
    for rank in range(schedule.pp):
        for chunk in range(schedule.vpp):
            for mb in range(schedule.num_microbatches):
                for j in range(schedule.num_slices):
                    for kind in (Kind.F, *backward_kinds):
                        expected[(rank, Action(kind, chunk, mb, j))] += 1
    return expected


def _check_complete(schedule: Schedule, progress: Optional[Progress] = None) -> None:
    expected = _expected_units(schedule)
    seen: Counter[Unit] = Counter()
    total, done = sum(len(row) for row in schedule.ranks), 0
    for rank, row in enumerate(schedule.ranks):
        report(progress, "checking completeness", done, total)
        done += len(row)
        for step, a in enumerate(row):
            if a.chunk >= schedule.vpp or a.microbatch >= schedule.num_microbatches or a.slice >= schedule.num_slices:
                raise ScheduleError(
                    f"rank {rank} step {step}: {a} is outside the schedule (chunk < {schedule.vpp}, "
                    f"microbatch < {schedule.num_microbatches}, slice < {schedule.num_slices})",
                    format_grid(schedule, {rank: step}),
                )
            if a.kind.is_compute:
                seen[(rank, a)] += 1
                if seen[(rank, a)] > 1:
                    raise ScheduleError(
                        f"rank {rank} step {step}: {a} appears twice", format_grid(schedule, {rank: step})
                    )
                if (rank, a) not in expected:
                    hint = "a forward-only schedule has no backward" if schedule.forward_only else "mixing B with I/W?"
                    raise ScheduleError(
                        f"rank {rank} step {step}: unexpected action {a} ({hint})", format_grid(schedule, {rank: step})
                    )
    missing = sorted((expected - seen).keys(), key=lambda x: (x[0], x[1]))
    if missing:
        rank, a = missing[0]
        raise ScheduleError(
            f"{len(missing)} compute action(s) missing, first: {a} on rank {rank}", format_grid(schedule)
        )
    if schedule.is_lowered:
        _check_communication_pairs(schedule)


def comm_key(schedule: Schedule, rank: int, a: Action) -> CommKey:
    stage = schedule.stage(rank, a.chunk)
    if a.kind is Kind.SEND_F:
        return ("F", stage + 1, a.microbatch, a.slice)
    if a.kind is Kind.RECV_F:
        return ("F", stage, a.microbatch, a.slice)
    if a.kind is Kind.SEND_B:
        return ("B", stage - 1, a.microbatch, a.slice)
    return ("B", stage, a.microbatch, a.slice)


def _check_communication_pairs(schedule: Schedule) -> None:
    sends: Counter[CommKey] = Counter()
    recvs: Counter[CommKey] = Counter()
    where = {}
    for rank, row in enumerate(schedule.ranks):
        for step, a in enumerate(row):
            if a.kind in (Kind.SEND_F, Kind.SEND_B):
                k = comm_key(schedule, rank, a)
                if not 0 <= k[1] < schedule.num_stages:
                    raise ScheduleError(
                        f"rank {rank} step {step}: {a} has no peer stage", format_grid(schedule, {rank: step})
                    )
                sends[k] += 1
                where[("s",) + k] = (rank, step)
            elif a.kind in (Kind.RECV_F, Kind.RECV_B):
                k = comm_key(schedule, rank, a)
                recvs[k] += 1
                where[("r",) + k] = (rank, step)
    for k in sends - recvs:
        rank, step = where[("s",) + k]
        raise ScheduleError(
            f"rank {rank} step {step}: {schedule.ranks[rank][step]} has no matching RECV",
            format_grid(schedule, {rank: step}),
        )
    for k in recvs - sends:
        rank, step = where[("r",) + k]
        raise ScheduleError(
            f"rank {rank} step {step}: {schedule.ranks[rank][step]} has no matching SEND",
            format_grid(schedule, {rank: step}),
        )


def _waits_for(walker: Walker, rank: int, a: Action) -> str:
    suffix = " (what it sends)" if a.kind in (Kind.SEND_F, Kind.SEND_B) else ""
    reasons = [describe(walker.schedule, f) + suffix for f in walker.unmet(rank, a)]
    partner = walker.waiting_partner(rank, a)
    if partner is not None:
        reasons.append(f"its context-exchange group member {partner[1]} on rank {partner[0]}")
    return "; ".join(reasons)


def validate(schedule: Schedule, progress: Optional[Progress] = None) -> Schedule:
    """Return ``schedule`` unchanged if it is complete and runs to the end; raise otherwise.
    ``progress``: ``("checking completeness", 0, actions)``, then now and then
    ``("checking dependencies", actions run through, actions)``."""
    _check_complete(schedule, progress)
    walker = Walker(schedule)
    stuck = walker.run(lambda rank, a, ready: 0.0, progress, "checking dependencies")
    if stuck:
        reasons = [
            f"  rank {r} step {step} {schedule.ranks[r][step]} waits for: "
            + _waits_for(walker, r, schedule.ranks[r][step])
            for r, step in stuck.items()
        ]
        raise ScheduleError(
            "schedule deadlocks or breaks a dependency:\n" + "\n".join(reasons), format_grid(schedule, stuck)
        )
    return schedule


def check_link_order(schedule: Schedule) -> Schedule:
    """Every directed link carries its messages in the same order on both ends.

    gloo matches messages by tag; NCCL matches point-to-point operations between two ranks in
    the order they are posted, so a lowered schedule must send and receive in one order per link.
    """
    if not schedule.is_lowered:
        raise ScheduleError("check_link_order needs a lowered schedule (add_communication)")
    sent: dict[tuple[int, int], list[CommKey]] = {}
    received: dict[tuple[int, int], list[CommKey]] = {}
    where: dict[tuple[int, CommKey], int] = {}
    for rank, row in enumerate(schedule.ranks):
        for step, a in enumerate(row):
            if a.kind in (Kind.SEND_F, Kind.SEND_B, Kind.RECV_F, Kind.RECV_B):
                k = comm_key(schedule, rank, a)
                peer_stage = k[1] + (-1 if a.kind is Kind.RECV_F else 1 if a.kind is Kind.RECV_B else 0)
                if a.kind in (Kind.SEND_F, Kind.SEND_B):
                    link = (rank, schedule.placement(k[1])[0])
                    sent.setdefault(link, []).append(k)
                else:
                    link = (schedule.placement(peer_stage)[0], rank)
                    received.setdefault(link, []).append(k)
                where[(rank, k)] = step
    for link, messages in sent.items():
        got = received.get(link, [])
        for i, (m_s, m_r) in enumerate(zip(messages, got)):
            if m_s != m_r:
                src, dst = link
                marks = {src: where[(src, m_s)], dst: where[(dst, m_r)]}
                raise ScheduleError(
                    f"link rank {src} -> rank {dst}: message {i} is sent as {m_s} but "
                    f"received as {m_r} (order differs; NCCL would mismatch them)",
                    format_grid(schedule, marks),
                )
    return schedule
