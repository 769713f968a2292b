"""Phase 1: units (whole documents, or one slice of a DP-merged outlier) onto DP ranks.

Forward and backward are balanced apart: a rank's load is ``max(F_r / F*, B_r / B*)`` with
``F*``, ``B*`` the per-rank means, so a rank full of attention-heavy work (backward-heavy) and
one full of short documents (GEMM-heavy) cannot hide behind equal sums. LPT on that load (largest
unit first, each to the rank whose load after taking it is least), then a local search that
moves or swaps units between the most loaded rank and the least loaded ones while the maximum
drops.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from megatron_slim.plan.pack.plan import Piece

Vector = npt.NDArray[np.float64]


@dataclass(frozen=True)
class Unit:
    pieces: tuple[Piece, ...]
    forward: float
    backward: float


@dataclass
class Loads:
    """Per-rank forward and backward sums, normalised by their per-rank means."""

    fwd: Vector
    bwd: Vector

    def load(self) -> Vector:
        result: Vector = np.maximum(self.fwd, self.bwd)
        return result

    def score(self) -> float:
        return float(self.load().max())


def normalised(units: list[Unit], dp: int) -> tuple[Vector, Vector]:
    f = np.array([u.forward for u in units], dtype=np.float64)
    b = np.array([u.backward for u in units], dtype=np.float64)
    f_mean = max(float(f.sum()) / dp, 1e-300)
    b_mean = max(float(b.sum()) / dp, 1e-300)
    return f / f_mean, b / b_mean


def loads_of(assign: list[int], f: Vector, b: Vector, dp: int) -> Loads:
    a = np.asarray(assign, dtype=np.int64)
    return Loads(np.bincount(a, f, dp).astype(np.float64), np.bincount(a, b, dp).astype(np.float64))


def lpt(f: Vector, b: Vector, dp: int) -> list[int]:
    """Largest unit first, each to the rank whose ``max(F, B)`` after taking it is least (a
    ``1e-9 (F + B)`` term breaks ties towards the less loaded rank in sum)."""
    fwd = np.zeros(dp)
    bwd = np.zeros(dp)
    tie = np.zeros(dp)  # 1e-9 * (fwd + bwd), kept up to date at the rank that changed
    after, other = np.empty(dp), np.empty(dp)  # buffers: no array is allocated per unit
    assign = [0] * len(f)
    f_list, b_list = f.tolist(), b.tolist()
    for u in np.argsort(-np.maximum(f, b), kind="stable").tolist():
        fu, bu = f_list[u], b_list[u]
        np.add(fwd, fu, out=after)
        np.add(bwd, bu, out=other)
        np.maximum(after, other, out=after)
        np.add(after, tie, out=after)
        r = int(after.argmin())
        fwd[r] += fu
        bwd[r] += bu
        tie[r] = 1e-9 * (fwd[r] + bwd[r])
        assign[u] = r
    return assign


def _try_pair(members: list[list[int]], f: Vector, b: Vector, loads: Loads, hi: int, lo: int) -> bool:
    """Move one unit hi -> lo, or swap one of hi's with one of lo's, if the pair's peak drops, or
    stays while the pair's sum of squared loads drops (a plateau move: with two loads per rank,
    the way down often leads sideways first)."""
    peak0 = max(loads.fwd[hi], loads.bwd[hi], loads.fwd[lo], loads.bwd[lo])
    square0 = loads.fwd[hi] ** 2 + loads.bwd[hi] ** 2 + loads.fwd[lo] ** 2 + loads.bwd[lo] ** 2
    mine = np.array(members[hi], dtype=np.int64)[:, None]
    theirs = np.array(members[lo] + [-1], dtype=np.int64)[None, :]
    tf = np.where(theirs >= 0, f[theirs], 0.0)
    tb = np.where(theirs >= 0, b[theirs], 0.0)
    hi_f, hi_b = loads.fwd[hi] - f[mine] + tf, loads.bwd[hi] - b[mine] + tb
    lo_f, lo_b = loads.fwd[lo] + f[mine] - tf, loads.bwd[lo] + b[mine] - tb
    peak = np.maximum(np.maximum(hi_f, hi_b), np.maximum(lo_f, lo_b)).ravel()
    square = (hi_f**2 + hi_b**2 + lo_f**2 + lo_b**2).ravel()
    j = int(np.lexsort((square, peak))[0])
    if not (peak[j] < peak0 - 1e-12 or (peak[j] <= peak0 + 1e-15 and square[j] < square0 - 1e-12)):
        return False
    best = (int(mine[j // theirs.shape[1], 0]), int(theirs[0, j % theirs.shape[1]]))
    u, v = best
    for unit, src, dst in ((u, hi, lo), (v, lo, hi)):
        if unit < 0:
            continue
        members[src].remove(unit)
        members[dst].append(unit)
        loads.fwd[src] -= f[unit]
        loads.bwd[src] -= b[unit]
        loads.fwd[dst] += f[unit]
        loads.bwd[dst] += b[unit]
    return True


def local_search(assign: list[int], f: Vector, b: Vector, dp: int, rounds: int = 100, partners: int = 4) -> list[int]:
    loads = loads_of(assign, f, b, dp)
    members: list[list[int]] = [[] for _ in range(dp)]
    for u, r in enumerate(assign):
        members[r].append(u)
    for _ in range(rounds):
        hi = int(loads.load().argmax())
        if len(members[hi]) < 2:
            break  # a lone unit is the floor: wherever it goes, that rank is at least as loaded
        # Partners: the least loaded overall, and the lightest in forward and in backward alone.
        lows = [int(r) for r in np.argsort(loads.load())[:partners]]
        lows += [int(loads.fwd.argmin()), int(loads.bwd.argmin())]
        if not any(_try_pair(members, f, b, loads, hi, lo) for lo in dict.fromkeys(lows) if lo != hi):
            break
    result = list(assign)
    for r, units in enumerate(members):
        for u in units:
            result[u] = r
    return result


def phase1(units: list[Unit], dp: int) -> list[int]:
    """Each unit's DP rank."""
    f, b = normalised(units, dp)
    return local_search(lpt(f, b, dp), f, b, dp)
