"""Schedule generators: integers in, compute-only ``Schedule`` out.

All three schedules are one template: each rank has a forward order and a backward order over
(chunk, microbatch, slice) units, runs ``warmup`` forwards, then alternates one forward and one
backward, then drains the remaining backwards. They differ only in those orders and the warmup:

* ``1f1b``: one unit per microbatch; warmup ``p - r - 1``.
* ``interleaved``: groups of ``p`` microbatches go through chunk 0, then chunk 1, ...; backward
  visits chunks in reverse; warmup ``(v - 1) * p + 2 (p - r - 1)`` (Megatron-LM's formula).
* ``slimpipe``: a microbatch is cut into ``n`` slices that go forward in order and backward in
  reverse (slice j's K/V gradient needs every later slice's backward). With ``v`` chunks, groups of
  ``g`` slices (the smallest divisor of ``n`` that is ``>= p``) go through chunk 0, chunk 1, ...;
  when ``n < p`` whole microbatches are grouped instead so a group still covers ``>= p`` units.

The warmup is the forward position of the rank's first backward plus the round trip to the last
stage: ``p - r - 1`` for one chunk, ``2 (p - r - 1)`` for interleaved chunks (the backward of the
last chunk wraps around the ring once more). For one chunk this keeps ``n + p - r - 1`` slices in
flight on rank ``r``: stage 0 holds ``A (1 + (p - 1) / n)``, below the SlimPipe paper's interleaved
bound ``A (1 + 2 (p - 1) / (n v))`` at ``v = 1``, at the same bubble.
"""

from __future__ import annotations

from megatron_slim.plan.schedule.ir import Action, Kind, Schedule

Unit = tuple[int, int, int]  # (chunk, microbatch, slice)


def _check(name: str, value: int, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum} (got {value!r})")


def _one_f_one_b(forwards: list[Unit], backwards: list[Unit], warmup: int) -> tuple[Action, ...]:
    warmup = min(warmup, len(forwards))
    order = [Action(Kind.F, *u) for u in forwards[:warmup]]
    b = 0
    for u in forwards[warmup:]:
        order.append(Action(Kind.F, *u))
        order.append(Action(Kind.B, *backwards[b]))
        b += 1
    order.extend(Action(Kind.B, *u) for u in backwards[b:])
    return tuple(order)


def _group_size(num_slices: int, pp: int) -> int:
    """Slices per chunk pass: the smallest divisor of ``num_slices`` that is at least ``pp``."""
    return next(g for g in range(pp, num_slices + 1) if num_slices % g == 0)


def _microbatch_groups(num_microbatches: int, size: int) -> list[range]:
    """Consecutive groups of ``size`` microbatches; a short final group joins the one before it
    (a final pass over fewer than ``pp`` units would stall on its own round trip)."""
    starts = list(range(0, num_microbatches, size))
    if len(starts) > 1 and num_microbatches - starts[-1] < size:
        starts.pop()
    return [range(a, b) for a, b in zip(starts, starts[1:] + [num_microbatches])]


def _chunked_orders(pp: int, vpp: int, num_microbatches: int, num_slices: int) -> tuple[list[Unit], list[Unit]]:
    """Forward and backward unit orders shared by every rank (only the warmup differs per rank)."""
    forwards: list[Unit] = []
    backwards: list[Unit] = []
    if vpp == 1:
        for mb in range(num_microbatches):
            forwards += [(0, mb, j) for j in range(num_slices)]
            backwards += [(0, mb, j) for j in reversed(range(num_slices))]
        return forwards, backwards
    if num_slices >= pp:
        g = _group_size(num_slices, pp)
        for mb in range(num_microbatches):
            mb_order = [
                (c, mb, j) for start in range(0, num_slices, g) for c in range(vpp) for j in range(start, start + g)
            ]
            forwards += mb_order
            backwards += mb_order[::-1]
        return forwards, backwards
    for group in _microbatch_groups(num_microbatches, -(-pp // num_slices)):
        forwards += [(c, mb, j) for c in range(vpp) for mb in group for j in range(num_slices)]
        backwards += [(c, mb, j) for c in reversed(range(vpp)) for mb in group for j in reversed(range(num_slices))]
    return forwards, backwards


def _build(kind: str, pp: int, vpp: int, num_microbatches: int, num_slices: int) -> Schedule:
    forwards, backwards = _chunked_orders(pp, vpp, num_microbatches, num_slices)
    position = {u: i for i, u in enumerate(forwards)}
    # The k-th backward runs after warmup + k + 1 forwards, so each rank needs at least this warmup
    # for its own backwards to follow their forwards; the first backward sets it for even groups.
    local_warmup = max(position[u] - k for k, u in enumerate(backwards))
    round_trip = 1 if vpp == 1 else 2
    ranks = tuple(_one_f_one_b(forwards, backwards, local_warmup + round_trip * (pp - r - 1)) for r in range(pp))
    return Schedule(kind, pp, vpp, num_microbatches, num_slices, ranks)


def one_f_one_b(pp: int, num_microbatches: int) -> Schedule:
    _check("pp", pp)
    _check("num_microbatches", num_microbatches)
    return _build("1f1b", pp, 1, num_microbatches, 1)


def interleaved(pp: int, vpp: int, num_microbatches: int) -> Schedule:
    _check("pp", pp)
    _check("vpp", vpp, 2)
    _check("num_microbatches", num_microbatches)
    return _build("interleaved", pp, vpp, num_microbatches, 1)


def slimpipe(pp: int, num_microbatches: int, num_slices: int, vpp: int = 1) -> Schedule:
    _check("pp", pp)
    _check("vpp", vpp)
    _check("num_microbatches", num_microbatches)
    _check("num_slices", num_slices)
    return _build("slimpipe", pp, vpp, num_microbatches, num_slices)


GENERATORS = ("1f1b", "interleaved", "slimpipe")


def generate(kind: str, pp: int, vpp: int, num_microbatches: int, num_slices: int) -> Schedule:
    """Dispatch by name; the error lists the valid names."""
    key = kind.lower()
    if key == "1f1b":
        if vpp != 1 or num_slices != 1:
            raise ValueError(f"1f1b takes vpp=1 and num_slices=1 (got vpp={vpp}, num_slices={num_slices})")
        return one_f_one_b(pp, num_microbatches)
    if key == "interleaved":
        if num_slices != 1:
            raise ValueError(f"interleaved takes num_slices=1 (got {num_slices}); use slimpipe")
        return interleaved(pp, vpp, num_microbatches)
    if key == "slimpipe":
        return slimpipe(pp, num_microbatches, num_slices, vpp)
    raise ValueError(f"schedule kind {kind!r}: unknown (allowed: {', '.join(GENERATORS)})")
