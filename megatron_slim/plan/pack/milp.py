"""Phase 2: MILP refinement of phase 1's rank assignment (scipy's HiGHS ``milp``, time budget).

Each round frees every unit of the most loaded rank and of one of the least loaded ones and
re-assigns them optimally between the two: minimise ``z`` subject to each unit on exactly one rank and, per
rank, ``sum f_u x_ur <= z`` and ``sum b_u x_ur <= z`` (loads normalised as in phase 1). A round's
answer is taken only when it lowers that subset's peak; rounds stop when one does not, or when
the budget is spent. So the result is never worse than the assignment it started from; a time-out
or an infeasible answer leaves it as it was. Without scipy the refinement is skipped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from megatron_slim.plan.pack.heuristic import Vector, loads_of


@dataclass(frozen=True)
class Refinement:
    assign: tuple[int, ...]
    rounds_taken: int
    solver: str  # "highs", or why it did not run


def _solve_subset(units: list[int], ranks: list[int], f: Vector, b: Vector, seconds: float) -> dict[int, int] | None:
    from scipy.optimize import Bounds, LinearConstraint, milp

    n, k = len(units), len(ranks)
    size = n * k + 1
    c = np.zeros(size)
    c[-1] = 1.0
    one = np.zeros((n, size))
    work = np.zeros((2 * k, size))
    for i, u in enumerate(units):
        one[i, i * k : (i + 1) * k] = 1.0
        for j in range(k):
            work[j, i * k + j] = f[u]
            work[k + j, i * k + j] = b[u]
    work[:, -1] = -1.0
    integrality = np.ones(size)
    integrality[-1] = 0
    upper = np.ones(size)
    upper[-1] = np.inf
    result = milp(
        c,
        constraints=[LinearConstraint(one, 1.0, 1.0), LinearConstraint(work, -np.inf, 0.0)],
        integrality=integrality,
        bounds=Bounds(np.zeros(size), upper),
        options={"time_limit": max(seconds, 0.01), "disp": False},
    )
    if result.x is None:
        return None
    x = np.asarray(result.x[:-1]).reshape(n, k)
    return {u: ranks[int(x[i].argmax())] for i, u in enumerate(units)}


def _improve(current: list[int], f: Vector, b: Vector, dp: int, ranks: list[int], seconds: float) -> bool:
    """Re-solve ``ranks``' units among themselves; apply and say True if their peak drops."""
    loads = loads_of(current, f, b, dp).load()
    units = [u for u, r in enumerate(current) if r in ranks]
    moved = _solve_subset(units, ranks, f, b, seconds)
    if moved is None:
        return False
    trial = list(current)
    for u, r in moved.items():
        trial[u] = r
    if float(loads_of(trial, f, b, dp).load()[ranks].max()) >= float(loads[ranks].max()) - 1e-9:
        return False
    current[:] = trial
    return True


def refine(assign: list[int], f: Vector, b: Vector, dp: int, budget_s: float, partners: int = 2) -> Refinement:
    """Pair the most loaded rank with each of the ``partners`` least loaded ones in turn and
    repartition the pair's units exactly; stop when no partner helps or the budget is spent."""
    try:
        import scipy.optimize  # noqa: F401
    except ImportError:
        return Refinement(tuple(assign), 0, "skipped: scipy is not installed")
    deadline = time.perf_counter() + budget_s
    current = list(assign)
    taken = 0
    while dp > 1 and time.perf_counter() < deadline:
        order = [int(r) for r in np.argsort(loads_of(current, f, b, dp).load())]
        for lo in order[:partners]:
            left = deadline - time.perf_counter()
            if left <= 0:
                break
            if _improve(current, f, b, dp, sorted({order[-1], lo}), left):
                taken += 1
                break
        else:
            break
    return Refinement(tuple(current), taken, "highs")
