"""Sequence lengths for context-parallel experiments: ``--lengths FILE|SPEC`` and packing.

SPEC forms (spaces are ignored; keys may come in any order):

* ``lognormal:mean=M,sigma=S,min=A,max=B`` -- ``M`` is the mean of the *untruncated* log-normal
  (so ``mu = ln(M) - S**2/2``); a draw is rounded to the nearest integer and redrawn until it lies
  in ``[A, B]`` (a truncated, not a clipped, distribution: no spikes at A or B).
* ``uniform:min=A,max=B`` -- integers uniform on ``[A, B]``.
* ``fixed:length=N``.
* ``mix:W1*KIND(k=v,...)+W2*KIND(k=v,...)`` -- each draw first picks a component with probability
  proportional to its weight, e.g.
  ``mix:0.9*lognormal(mean=4096,sigma=1,min=256,max=32768)+0.1*uniform(min=65536,max=262144)``.

FILE: an existing path; one positive integer per line, ``#`` starts a comment, blank lines are
skipped. A file's lengths are used in file order and cycled from the top when the batch needs
more; the seed does not change them.

Packing (``make_packs``): sequences are drawn (each truncated to the pack length ``L``) until
their total covers ``num_packs * L``; in draw order, each goes to the first of the ``num_packs``
packs (capacity ``L``) with room for it (first fit, so every pack gets a random mix; first-fit
*decreasing* would crowd the longest sequences into the first packs). A drawn sequence that fits
no pack is set aside. Every pack's final gap is then filled, packs in order, by the next
set-aside sequence (in draw order) truncated to the gap: every set-aside sequence is longer than
every final gap (it did not fit while the gaps were at least as large), so one filler closes a
gap. Only when the set-aside sequences run out are further sequences drawn, each placed whole or
truncated to what is left of the gap. Unused set-aside sequences are dropped. So every pack
holds exactly ``L`` tokens, and the result depends only on (source, L, packs, seed).
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from megatron_slim.plan.schema import ConfigError, fail

SPEC_FORMS = (
    "lognormal:mean=..,sigma=..,min=..,max=..",
    "uniform:min=..,max=..",
    "fixed:length=..",
    "mix:W*KIND(k=v,..)+W*KIND(..)",
    "a file with one length per line",
)
_PARAMS = {"lognormal": ("mean", "sigma", "min", "max"), "uniform": ("min", "max"), "fixed": ("length",)}
_MAX_REJECTIONS = 100_000


@dataclass(frozen=True)
class Distribution:
    """One parametric length distribution (``lognormal``, ``uniform`` or ``fixed``)."""

    kind: str
    params: tuple[tuple[str, float], ...]

    def param(self, name: str) -> float:
        return dict(self.params)[name]

    def draw(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.param("length"))
        lo, hi = int(self.param("min")), int(self.param("max"))
        if self.kind == "uniform":
            return rng.randint(lo, hi)
        sigma = self.param("sigma")
        mu = math.log(self.param("mean")) - sigma * sigma / 2
        for _ in range(_MAX_REJECTIONS):
            value = int(round(rng.lognormvariate(mu, sigma)))
            if lo <= value <= hi:
                return value
        raise ConfigError(
            f"--lengths lognormal: [min={lo}, max={hi}] holds almost none of the "
            f"distribution's mass (allowed: a window around mean={self.param('mean')})"
        )


@dataclass(frozen=True)
class LengthSource:
    """Where sequence lengths come from: weighted distributions, or a file's fixed list."""

    spec: str
    components: tuple[tuple[float, Distribution], ...] = ()
    file_lengths: tuple[int, ...] = ()

    def stream(self, seed: int) -> Iterator[int]:
        """Endless lengths: seeded draws, or the file's lengths in order, cycled."""
        if self.file_lengths:
            while True:
                yield from self.file_lengths
        rng = random.Random(seed)
        weights = [w for w, _ in self.components]
        while True:
            if len(self.components) == 1:
                dist = self.components[0][1]
            else:
                dist = rng.choices([d for _, d in self.components], weights)[0]
            yield dist.draw(rng)


def _parse_params(kind: str, body: str, where: str) -> Distribution:
    if kind not in _PARAMS:
        raise fail(f"{where} kind", kind, ", ".join(list(_PARAMS) + ["mix"]))
    values: dict[str, float] = {}
    for item in (p for p in body.split(",") if p):
        key, eq, raw = item.partition("=")
        if not eq or key not in _PARAMS[kind]:
            raise fail(f"{where} {kind}", item, f"keys {', '.join(_PARAMS[kind])} as key=value")
        try:
            values[key] = float(raw)
        except ValueError:
            raise fail(f"{where} {kind}.{key}", raw, "a finite number") from None
        if not math.isfinite(values[key]):
            raise fail(f"{where} {kind}.{key}", raw, "a finite number")
    missing = [k for k in _PARAMS[kind] if k not in values]
    if missing:
        raise fail(f"{where} {kind}.{missing[0]}", None, f"all of {', '.join(_PARAMS[kind])}", problem="missing key")
    _check_params(kind, values, where)
    return Distribution(kind, tuple((k, values[k]) for k in _PARAMS[kind]))


def _check_params(kind: str, v: dict[str, float], where: str) -> None:
    ints = [k for k in ("min", "max", "length") if k in v]
    for k in ints:
        if v[k] < 1 or not float(v[k]).is_integer():
            raise fail(f"{where} {kind}.{k}", v[k], "an integer >= 1")
    if "min" in v and v["max"] < v["min"]:
        raise fail(f"{where} {kind}.max", v["max"], f"an integer >= min={int(v['min'])}")
    if kind == "lognormal":
        if v["mean"] <= 0:
            raise fail(f"{where} lognormal.mean", v["mean"], "a number > 0")
        if v["sigma"] <= 0:
            raise fail(f"{where} lognormal.sigma", v["sigma"], "a number > 0")


_COMPONENT = re.compile(r"^([0-9.eE+-]+)\*([a-z]+)\((.*)\)$")


def _split_top_level(text: str, sep: str) -> list[str]:
    parts: list[str] = []
    depth = 0
    cur: list[str] = []
    for ch in text:
        depth += (ch == "(") - (ch == ")")
        if ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return parts


def _parse_mix(body: str) -> tuple[tuple[float, Distribution], ...]:
    out = []
    for i, part in enumerate(_split_top_level(body, "+")):
        m = _COMPONENT.match(part)
        if not m:
            raise fail(f"--lengths mix[{i}]", part, "W*KIND(k=v,...) joined by '+', KIND one of " + ", ".join(_PARAMS))
        try:
            weight = float(m.group(1))
        except ValueError:
            raise fail(f"--lengths mix[{i}].weight", m.group(1), "a number > 0") from None
        if not (math.isfinite(weight) and weight > 0):
            raise fail(f"--lengths mix[{i}].weight", m.group(1), "a finite number > 0")
        out.append((weight, _parse_params(m.group(2), m.group(3), f"--lengths mix[{i}]")))
    return tuple(out)


def read_lengths_file(path: Path) -> tuple[int, ...]:
    lengths = []
    from megatron_slim.plan.files import read_text

    for lineno, line in enumerate(read_text(path, f"--lengths {path}").splitlines(), 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise fail(f"--lengths {path}:{lineno}", text, "one positive integer per line (# comments allowed)")
        lengths.append(value)
    if not lengths:
        raise fail(f"--lengths {path}", "(no lengths)", "a file with at least one positive integer")
    return tuple(lengths)


def parse_lengths(text: str) -> LengthSource:
    """``--lengths`` value -> a length source. An existing path is a FILE, anything else a SPEC."""
    raw = (text or "").strip()
    if raw and Path(raw).is_file():
        return LengthSource(raw, file_lengths=read_lengths_file(Path(raw)))
    spec = re.sub(r"\s+", "", raw)
    kind, colon, body = spec.partition(":")
    if not colon:
        raise fail("--lengths", text, " | ".join(SPEC_FORMS), problem="not an existing file or a spec")
    if kind == "mix":
        return LengthSource(spec, components=_parse_mix(body))
    return LengthSource(spec, components=((1.0, _parse_params(kind, body, "--lengths")),))


def make_packs(source: LengthSource, pack_length: int, num_packs: int, seed: int = 0) -> tuple[tuple[int, ...], ...]:
    """``num_packs`` packs of exactly ``pack_length`` tokens (the rule is in the module docstring).

    Within a pack, sequences are in placement order (draw order, gap fillers last)."""
    if pack_length < 1:
        raise fail("model.seq_length", pack_length, "an integer >= 1")
    if num_packs < 1:
        raise fail("train.global_batch_size", num_packs, "an integer >= 1")
    pool: list[int] = []
    total = 0
    stream = source.stream(seed)
    while total < num_packs * pack_length:
        length = min(next(stream), pack_length)
        pool.append(length)
        total += length
    packs: list[list[int]] = [[] for _ in range(num_packs)]
    gaps = [pack_length] * num_packs
    aside: list[int] = []
    for s in pool:
        for p in range(num_packs):
            if s <= gaps[p]:
                packs[p].append(s)
                gaps[p] -= s
                break
        else:
            aside.append(s)
    fillers = iter(aside)
    for p in range(num_packs):
        while gaps[p]:
            filler = next(fillers, None)
            s = min(next(stream), pack_length) if filler is None else filler
            piece = min(s, gaps[p])  # a longer sequence contributes its head, truncated to the gap
            packs[p].append(piece)
            gaps[p] -= piece
    return tuple(tuple(p) for p in packs)
