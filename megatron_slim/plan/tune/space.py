"""The search space of ``megatron-slim plan``: every valid (layout, schedule, slices, recompute) of a
recipe on a GPU count, as ``Candidate`` values, and the recipe each one stands for.

Only valid points are enumerated, so no candidate fails the recipe's own checks:
tp <= min(8, GPUs per node) divides the heads, query groups and FFN width; cp divides the GPUs
left and (cp > 1) ``seq_length / 2``; pp divides the layers and vpp the layers per rank;
dp = gpus / (tp*cp*pp) divides the global batch in micro-batches. SlimPipe's slice counts are powers
of two between 2 and ``max_slices`` that cut the sequence into equal slices of whole alignment units
(``cost/slicing.py``), each CP rank's share at least ``MIN_SLICE_TOKENS_PER_GPU`` tokens: the cost
model prices GEMMs at one efficiency, so without that floor ever thinner slices would always look
better while real kernels slow down (short sequences, which no count meets, get the smallest one).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Iterator, cast, get_args

from megatron_slim.plan.cost.slicing import slice_alignment, splits_uniformly
from megatron_slim.plan.recipe import (
    MEGATRON_CP_ENGINE,
    CPConfig,
    CPEngine,
    ParallelConfig,
    Recipe,
    ScheduleKind,
    SlicePolicy,
)
from megatron_slim.plan.recompute import OFFLOAD_RATIOS, Recompute, recompute_choices

MAX_TP = 8  # tensor parallelism stays inside one NVLink node
MAX_SLICES = 64
MIN_SLICE_TOKENS_PER_GPU = 2048

# What one recompute choice sets in the recipe's train section, as (field, value) pairs. The choices
# come from plan/recompute.py (``recompute_choices``: none, selective core_attn[+mlp], full uniform 1
# and full block with every depth of a chunk) and its ``OFFLOAD_RATIOS`` where the schedule can
# offload (SlimPipe's per-slice offload, ``--slimpipe-offload-ratio`` under the launcher: Megatron-LM's
# own schedules have no such hook, so its baselines search no offload).
RecomputeOption = tuple[tuple[str, object], ...]


def recompute_options(layers_per_chunk: int, offload: bool) -> tuple[RecomputeOption, ...]:
    """Every recompute choice without offload, and offload without recompute: the two ways to trade
    time for activation memory. Mixing them is left out of the search (offloading what a checkpoint
    keeps saves little) so that a 256-GPU search stays within its minute."""
    ratios = [x for x in OFFLOAD_RATIOS if x > 0] if offload else []
    offloaded = [Recompute(offload_ratio=x) for x in ratios]
    return tuple(_fields(r) for r in (*recompute_choices(layers_per_chunk), *offloaded))


def describe(option: RecomputeOption) -> str:
    """``none``, ``selective core_attn+mlp``, ``full block 2``, with ``, offload 0.25`` when offloading."""
    f = dict(option)
    text = str(f["recompute"])
    if text == "full":
        text += f" {f['recompute_method']} {f['recompute_num_layers']}"
    elif text == "selective":
        text += " " + "+".join(cast(tuple[str, ...], f["recompute_modules"]))
    ratio = cast(float, f.get("offload_ratio", 0.0))
    return text + (f", offload {ratio:g}" if ratio else "")


def _fields(r: Recompute) -> RecomputeOption:
    return tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in r.train_fields().items())


SLICE_POLICIES: tuple[str, ...] = get_args(SlicePolicy)


def exchange_runs(recipe: Recipe, layout: Layout) -> bool:
    """Whether a context-exchange candidate is worth searching and runs as emitted: it needs several
    pipeline ranks (on one it is uniform slices), and train and the launcher refuse it with
    ``schedule.vocab_parallel`` or packed windows (``plan/startup/rules_slimpipe.py``)."""
    return layout.pp > 1 and not recipe.schedule.vocab_parallel and recipe.data.packing == "none"


FAMILIES: dict[str, tuple[str, ...]] = {"slimpipe": ("slimpipe",), "megatron": ("1f1b", "interleaved")}


@dataclass(frozen=True, order=True)
class Layout:
    tp: int
    cp: int
    pp: int
    dp: int


@dataclass(frozen=True, order=True)
class Candidate:
    kind: str
    tp: int
    cp: int
    pp: int
    vpp: int
    dp: int
    num_slices: int
    slice_policy: str
    recompute: RecomputeOption

    @property
    def label(self) -> str:
        v = f" v{self.vpp}" if self.vpp > 1 else ""
        n = f" n{self.num_slices} {self.slice_policy}" if self.kind == "slimpipe" else ""
        return f"{self.kind}{v}{n} t{self.tp} c{self.cp} p{self.pp} d{self.dp} recompute={describe(self.recompute)}"


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending (trial division up to its square root)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def tp_choices(recipe: Recipe) -> list[int]:
    m = recipe.model
    top = min(MAX_TP, recipe.hardware_profile.gpus_per_node)
    return [
        t
        for t in range(1, top + 1)
        if not (m.num_attention_heads % t or m.num_query_groups % t or m.ffn_hidden_size % t)
    ]


def usable_gpu_counts(recipe: Recipe) -> list[int]:
    """Every GPU count some layout of ``layouts`` uses, ascending: the products of the choices the
    recipe allows for tp, cp (2*cp dividing the sequence), pp (dividing the layers) and dp (dividing
    the microbatches of a global batch)."""
    m, t = recipe.model, recipe.train
    cps = [1, *(c for c in divisors(m.seq_length // 2) if c > 1)] if m.seq_length % 2 == 0 else [1]
    dps = divisors(t.global_batch_size // t.micro_batch_size) if t.global_batch_size % t.micro_batch_size == 0 else [1]
    return sorted(
        {tp * cp * pp * dp for tp in tp_choices(recipe) for cp in cps for pp in divisors(m.num_layers) for dp in dps}
    )


def layouts(recipe: Recipe, gpus: int) -> list[Layout]:
    """Every (tp, cp, pp, dp) that uses exactly ``gpus`` GPUs and passes the recipe's checks."""
    m, t = recipe.model, recipe.train
    found = []
    for tp in tp_choices(recipe):
        if gpus % tp:
            continue
        for cp in divisors(gpus // tp):
            if cp > 1 and m.seq_length % (2 * cp):
                continue
            for pp in divisors(gpus // (tp * cp)):
                dp = gpus // (tp * cp * pp)
                if m.num_layers % pp == 0 and t.global_batch_size % (dp * t.micro_batch_size) == 0:
                    found.append(Layout(tp, cp, pp, dp))
    return found


def slice_counts(seq_length: int, layout: Layout, max_slices: int = MAX_SLICES) -> list[int]:
    """Powers of two from 2 to ``max_slices`` giving equal slices of whole alignment units, each CP
    rank's share at least ``MIN_SLICE_TOKENS_PER_GPU`` tokens (if none is that long: the smallest count)."""
    unit = slice_alignment(layout.cp, layout.tp, layout.tp > 1)
    aligned = [n for n in (2**k for k in range(1, max_slices.bit_length())) if splits_uniformly(seq_length, n, unit)]
    long_enough = [n for n in aligned if seq_length // (n * layout.cp) >= MIN_SLICE_TOKENS_PER_GPU]
    return long_enough or aligned[:1]


def _schedules(recipe: Recipe, layout: Layout, kind: str, max_slices: int) -> Iterator[tuple[int, int, str]]:
    """(vpp, num_slices, slice_policy) of ``kind`` on ``layout``."""
    vpps = divisors(recipe.model.num_layers // layout.pp)
    if kind == "1f1b":
        yield 1, 1, "uniform"
    elif kind == "interleaved":
        yield from ((v, 1, "uniform") for v in vpps if v >= 2 and layout.pp > 1)
    else:
        exchange = exchange_runs(recipe, layout)
        policies = [x for x in SLICE_POLICIES if exchange or x != "exchange"]
        for v in vpps if layout.pp > 1 else [1]:
            for n in slice_counts(recipe.model.seq_length, layout, max_slices):
                yield from ((v, n, policy) for policy in policies)


def candidates(
    recipe: Recipe,
    gpus: int,
    kinds: tuple[str, ...],
    max_slices: int = MAX_SLICES,
) -> list[Candidate]:
    """Every candidate of the schedule ``kinds`` on ``gpus`` GPUs, in a fixed order."""
    out = []
    for layout in layouts(recipe, gpus):
        for kind in kinds:
            for vpp, n, policy in _schedules(recipe, layout, kind, max_slices):
                chunk = recipe.model.num_layers // (layout.pp * vpp)
                for option in recompute_options(chunk, offload=kind == "slimpipe"):
                    out.append(Candidate(kind, layout.tp, layout.cp, layout.pp, vpp, layout.dp, n, policy, option))
    return sorted(out)


def candidate_recipe(base: Recipe, c: Candidate) -> Recipe:
    """``base`` run as ``c``: sequence parallelism with any TP; SlimPipe runs CP itself (ring, no remap),
    the Megatron baseline Megatron-LM's own CP (``cp.engine=megatron``), the attention the cost model
    prices for 1f1b/interleaved."""
    parallel = ParallelConfig(tp=c.tp, pp=c.pp, vpp=c.vpp, cp=c.cp, dp=c.dp, sequence_parallel=c.tp > 1)
    kind, policy = cast(ScheduleKind, c.kind), cast(SlicePolicy, c.slice_policy)
    schedule = dataclasses.replace(base.schedule, kind=kind, num_slices=c.num_slices, slice_policy=policy)
    train = dataclasses.replace(base.train, **cast(dict[str, Any], dict(c.recompute)))
    cp = CPConfig(engine=cp_engine(c), remap=False)
    return _replace_sections(base, parallel=parallel, schedule=schedule, train=train, cp=cp)


def cp_engine(c: Candidate) -> CPEngine:
    return "ring" if c.kind == "slimpipe" else MEGATRON_CP_ENGINE


def _replace_sections(base: Recipe, **sections: object) -> Recipe:
    """``dataclasses.replace(base, **sections)`` with the same checks, minus re-reading the hardware
    profile's YAML for every candidate: a copy keeps ``base``'s loaded profile (its only cached
    property, and the same file), then ``__post_init__`` runs every cross-section check."""
    recipe = copy.copy(base)
    for name, value in sections.items():
        object.__setattr__(recipe, name, value)
    recipe.__post_init__()
    return recipe


def settings(c: Candidate) -> dict[str, object]:
    """The recipe fields a candidate sets, as ``--set`` keys."""
    out: dict[str, object] = {
        "parallel.tp": c.tp,
        "parallel.cp": c.cp,
        "parallel.pp": c.pp,
        "parallel.vpp": c.vpp,
        "parallel.dp": c.dp,
        "parallel.sequence_parallel": c.tp > 1,
        "schedule.kind": c.kind,
        "schedule.num_slices": c.num_slices,
        "schedule.slice_policy": c.slice_policy,
        "cp.engine": cp_engine(c),
        "cp.remap": False,
    }
    out.update({f"train.{k}": ",".join(v) if isinstance(v, tuple) else v for k, v in c.recompute})
    return out
