"""A small discrete-event engine for one layer pass of context-parallel attention.

Two kinds of task:

* **compute** -- runs on its rank's single compute stream for ``duration`` seconds. A rank runs one
  task at a time, non-preemptively; when it is free it starts the ready task with the smallest
  ``priority`` (the attention engine's queue order: inter-node rings, then intra-node rings, then
  local sequences, which therefore fill the gaps while rings wait for K/V).
* **comm** -- starts as soon as its dependencies are done (communication runs on its own streams)
  and loads network *resources*: a GPU's NVLink out/in and a rank's NIC share out/in. Each
  resource serves its loads first come, first served; a task's part on a resource starts when the
  resource is free and lasts ``seconds``; the task ends when its last part ends, plus the link
  latency. Concurrent transfers thus share a link by queueing on it, which gives every transfer
  the same total as fair sharing would give the last one to finish.

Collectives are single comm tasks whose dependencies are every participant's preceding work: the
participants synchronise there.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Iterable

Resource = tuple[str, int]  # ("nvl_out" | "nvl_in" | "nic_out" | "nic_in", rank)
Priority = tuple[float, ...]  # lower runs first among a rank's ready tasks
Deps = Iterable[int]  # ids of the tasks a task waits for

_DONE, _READY, _DISPATCH = 0, 1, 2


@dataclass
class Task:
    rank: int  # compute: the rank; comm: -1
    duration: float
    loads: tuple[tuple[Resource, float], ...]
    latency: float
    deps: tuple[int, ...]
    priority: Priority
    category: str  # "attention" | "linear" | "comm"
    name: str = ""  # what the task is, for traces: "mlp", or its CP step's name (GroupTask.step_name)
    detail: str = ""  # which part of the step, for traces: "seq 3 (17 tokens)", "routed part 1 dispatch"


@dataclass
class TaskGraph:
    num_ranks: int
    tasks: list[Task] = field(default_factory=list)

    def compute(
        self,
        rank: int,
        duration: float,
        deps: Deps,
        priority: Priority,
        category: str = "attention",
        name: str = "",
        detail: str = "",
    ) -> int:
        self.tasks.append(Task(rank, max(0.0, duration), (), 0.0, tuple(deps), priority, category, name, detail))
        return len(self.tasks) - 1

    def comm(
        self,
        loads: dict[Resource, float] | tuple[tuple[Resource, float], ...],
        latency: float,
        deps: Deps,
        name: str = "",
        detail: str = "",
    ) -> int:
        items = tuple(sorted(loads.items())) if isinstance(loads, dict) else tuple(loads)
        self.tasks.append(
            Task(-1, 0.0, tuple((r, s) for r, s in items if s > 0), latency, tuple(deps), (), "comm", name, detail)
        )
        return len(self.tasks) - 1


@dataclass
class Timeline:
    end: list[float]
    start: list[float]
    busy: dict[int, dict[str, float]]  # rank -> category -> seconds of compute
    resource_busy: dict[Resource, float]
    makespan: float
    # (task, resource, start, end): when each comm task occupied each resource; a resource serves
    # one load at a time, so one resource's intervals never overlap
    occupancy: list[tuple[int, Resource, float, float]] = field(default_factory=list)


def _dependents(tasks: list[Task]) -> list[list[int]]:
    """For each task, the tasks that depend on it."""
    dependents: list[list[int]] = [[] for _ in tasks]
    for tid, t in enumerate(tasks):
        for d in t.deps:
            dependents[d].append(tid)
    return dependents


def _queue_loads(
    tid: int,
    task: Task,
    now: float,
    free_at: dict[Resource, float],
    resource_busy: dict[Resource, float],
    occupancy: list[tuple[int, Resource, float, float]],
) -> float:
    """Queue comm task ``tid``'s loads on their resources from ``now``; returns when the last one ends."""
    finish = now
    for res, seconds in task.loads:
        s = max(free_at.get(res, 0.0), now)
        free_at[res] = s + seconds
        resource_busy[res] = resource_busy.get(res, 0.0) + seconds
        occupancy.append((tid, res, s, s + seconds))
        finish = max(finish, s + seconds)
    return finish


def run(graph: TaskGraph) -> Timeline:
    tasks = graph.tasks
    n = len(tasks)
    remaining = [len(t.deps) for t in tasks]
    dependents = _dependents(tasks)
    start = [0.0] * n
    end = [0.0] * n
    free_at: dict[Resource, float] = {}
    resource_busy: dict[Resource, float] = {}
    occupancy: list[tuple[int, Resource, float, float]] = []
    pools: list[list[tuple[Priority, int]]] = [[] for _ in range(graph.num_ranks)]
    idle = [True] * graph.num_ranks
    busy: dict[int, dict[str, float]] = {r: {} for r in range(graph.num_ranks)}
    heap: list[tuple[float, int, int, int]] = []
    counter = 0

    def push(time: float, kind: int, item: int) -> None:
        nonlocal counter
        heapq.heappush(heap, (time, kind, counter, item))
        counter += 1

    for tid in range(n):
        if remaining[tid] == 0:
            push(0.0, _READY, tid)
    done = 0
    now = 0.0
    while heap:
        now, kind, _, item = heapq.heappop(heap)
        if kind == _DONE:
            done += 1
            t = tasks[item]
            end[item] = now
            if t.rank >= 0:
                idle[t.rank] = True
                push(now, _DISPATCH, t.rank)
            for d in dependents[item]:
                remaining[d] -= 1
                if remaining[d] == 0:
                    push(now, _READY, d)
        elif kind == _READY:
            t = tasks[item]
            if t.rank >= 0:
                heapq.heappush(pools[t.rank], (t.priority, item))
                push(now, _DISPATCH, t.rank)
                continue
            start[item] = now
            finish = _queue_loads(item, t, now, free_at, resource_busy, occupancy)
            push(finish + t.latency, _DONE, item)
        else:
            rank = item
            if idle[rank] and pools[rank]:
                _, tid = heapq.heappop(pools[rank])
                t = tasks[tid]
                idle[rank] = False
                start[tid] = now
                busy[rank][t.category] = busy[rank].get(t.category, 0.0) + t.duration
                push(now + t.duration, _DONE, tid)
    if done != n:
        raise RuntimeError(f"CP simulation stalled: {n - done} of {n} tasks never ran (dependency cycle)")
    return Timeline(end, start, busy, resource_busy, max(end, default=0.0), occupancy)


@dataclass(frozen=True)
class Span:
    """One interval of a trace: a compute task on its rank's ``compute`` stream, or a comm task's
    load on one resource (``stream`` = ``nvl_out`` | ``nvl_in`` | ``nic_out`` | ``nic_in`` of ``rank``)."""

    rank: int
    stream: str
    category: str
    name: str
    start: float
    end: float
    detail: str = ""


def spans(graph: TaskGraph, timeline: Timeline) -> list[Span]:
    """Every interval of ``timeline`` with positive length, compute tasks then resource loads."""
    out = [
        Span(t.rank, "compute", t.category, t.name, timeline.start[i], timeline.end[i], t.detail)
        for i, t in enumerate(graph.tasks)
        if t.rank >= 0 and timeline.end[i] > timeline.start[i]
    ]
    out += [
        Span(res[1], res[0], "comm", graph.tasks[i].name, s, e, graph.tasks[i].detail)
        for i, res, s, e in timeline.occupancy
        if e > s
    ]
    return out
