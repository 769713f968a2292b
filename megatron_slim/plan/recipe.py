"""Recipes: validated, frozen descriptions of a training run (model, parallelism, schedule, hardware).

A recipe is YAML in ``megatron_slim/configs/<name>.yaml`` (``paths.config_dir()``); ``load_recipe``
builds it, applies ``--set`` overrides and checks every cross-field rule before any work starts.
Megatron-LM flags are derived from a recipe (``megatron_slim.megatron.launch.args``), never written twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Optional

from megatron_slim.plan.cost.slicing import max_slices, slice_alignment, splits_aligned, splits_uniformly
from megatron_slim.plan.dynmo.options import DynmoConfig
from megatron_slim.plan.dynmo.recipe_checks import check_dynmo
from megatron_slim.plan.files import load_yaml_mapping
from megatron_slim.plan.hardware import HardwareProfile, load_hardware
from megatron_slim.plan.pack.dp_merge import merge_runs
from megatron_slim.plan.paths import config_dir
from megatron_slim.plan.recipe_sections import (
    MAX_SEED,
    MEGATRON_CP_ENGINE,
    SLICED_CP_ENGINES,
    CPConfig,
    CPEngine,
    DataConfig,
    ModelConfig,
    ParallelConfig,
    ScheduleConfig,
    ScheduleKind,
    SlicePolicy,
    TrainConfig,
)
from megatron_slim.plan.schema import ConfigError, apply_overrides, build, fail, to_dict

# The section dataclasses live in recipe_sections; callers import them from here, with the recipe.
__all__ = [
    "MAX_SEED",
    "MEGATRON_CP_ENGINE",
    "CPConfig",
    "CPEngine",
    "DataConfig",
    "ModelConfig",
    "ParallelConfig",
    "Recipe",
    "ScheduleConfig",
    "ScheduleKind",
    "SlicePolicy",
    "TrainConfig",
    "available_recipes",
    "load_recipe",
    "recipe_from_dict",
    "recipe_path",
]


@dataclass(frozen=True)
class Recipe:
    model: ModelConfig
    train: TrainConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    cp: CPConfig = field(default_factory=CPConfig)
    data: DataConfig = field(default_factory=DataConfig)
    dynmo: DynmoConfig = field(default_factory=DynmoConfig)
    hardware: str = "h100"
    name: str = ""
    description: str = ""

    def __post_init__(self) -> None:
        self._check_parallel_fits_model()
        self._check_batch()
        self._check_schedule()
        self._check_recompute_depth()
        check_dynmo(self)
        self._check_packing()
        _ = self.hardware_profile  # an unknown profile fails here, before any work

    def _check_parallel_fits_model(self) -> None:
        m, p = self.model, self.parallel
        chunks = p.pp * p.vpp
        if m.num_layers % chunks:
            field_name = "parallel.vpp" if p.vpp > 1 and m.num_layers % p.pp == 0 else "parallel.pp"
            raise fail(
                field_name,
                getattr(p, field_name.split(".")[1]),
                f"values with pp*vpp dividing model.num_layers={m.num_layers} (now pp*vpp={chunks})",
            )
        if p.layers_per_stage and sum(p.layers_per_stage) != m.num_layers:
            raise fail(
                "parallel.layers_per_stage",
                list(p.layers_per_stage),
                f"{p.pp} per-stage counts summing to model.num_layers={m.num_layers}, or [] for the even split",
            )
        if m.num_attention_heads % p.tp:
            raise fail("parallel.tp", p.tp, f"a divisor of model.num_attention_heads={m.num_attention_heads}")
        if m.num_query_groups % p.tp:
            raise fail("parallel.tp", p.tp, f"a divisor of model.num_query_groups={m.num_query_groups}")
        if m.ffn_hidden_size % p.tp:
            raise fail("parallel.tp", p.tp, f"a divisor of model.ffn_hidden_size={m.ffn_hidden_size}")
        if p.cp > 1 and m.seq_length % (2 * p.cp):
            raise fail(
                "model.seq_length", m.seq_length, f"a multiple of 2*parallel.cp={2 * p.cp} (zigzag context parallelism)"
            )

    def _check_batch(self) -> None:
        t, p = self.train, self.parallel
        per_step = t.micro_batch_size * p.dp
        if t.global_batch_size % per_step:
            raise fail(
                "train.global_batch_size",
                t.global_batch_size,
                f"a multiple of train.micro_batch_size*parallel.dp={per_step}",
            )

    def _check_schedule(self) -> None:
        s, p = self.schedule, self.parallel
        if s.kind == "1f1b":
            if p.vpp != 1:
                raise fail("parallel.vpp", p.vpp, "1 with schedule.kind=1f1b (use interleaved or slimpipe)")
            if s.num_slices != 1:
                raise fail("schedule.num_slices", s.num_slices, "1 with schedule.kind=1f1b (use slimpipe)")
        elif s.kind == "interleaved":
            if p.vpp < 2:
                raise fail("parallel.vpp", p.vpp, "an integer >= 2 with schedule.kind=interleaved")
            if s.num_slices != 1:
                raise fail("schedule.num_slices", s.num_slices, "1 with schedule.kind=interleaved (use slimpipe)")
        if s.kind == "slimpipe" and p.cp > 1 and (self.cp.engine not in SLICED_CP_ENGINES or self.cp.remap):
            raise fail(
                "cp.engine",
                self.cp.engine,
                f"one of {', '.join(SLICED_CP_ENGINES)} (ring is the default) with cp.remap=false when "
                "schedule.kind=slimpipe: megatron-slim train plans each window with the engine and runs every "
                "slice as query-out attention over that plan and the K/V cache (the Megatron-LM launcher runs "
                "its own zigzag query-out); the other engines run under 1f1b/interleaved (megatron: "
                "Megatron-LM's own CP, whose attention cannot read SlimPipe's K/V cache of earlier slices)",
            )
        allowed = self._allowed_slice_counts()
        if allowed is not None:
            raise fail("schedule.num_slices", s.num_slices, allowed)

    def _allowed_slice_counts(self) -> str | None:
        """What ``schedule.num_slices`` may be when the slice policy cannot split the sequence, else None."""
        seq_length, num_slices, unit = self.model.seq_length, self.schedule.num_slices, self.slice_alignment
        if self.schedule.slice_policy in ("uniform", "exchange"):  # exchange keeps uniform slices
            if splits_uniformly(seq_length, num_slices, unit):
                return None
            return (
                f"a count whose slices divide model.seq_length={seq_length} into equal parts "
                f"that are multiples of {unit} tokens (or use schedule.slice_policy=balanced)"
            )
        if splits_aligned(seq_length, num_slices, unit):
            return None
        most = max_slices(seq_length, unit)
        return f"at most model.seq_length/{unit}={most} slices, with model.seq_length a multiple of {unit}"

    def _check_packing(self) -> None:
        """Packed windows are one MicroPack each (b=1) through SlimPipe's attention (``query_out_cp`` if CP)."""
        packing, t, p, s = self.data.packing, self.train, self.parallel, self.schedule
        if packing == "none":
            return
        for name, value, allowed in (
            ("train.micro_batch_size", t.micro_batch_size, 1),
            ("schedule.vocab_parallel", s.vocab_parallel, False),
        ):
            if value != allowed:
                raise fail(name, value, f"{str(allowed).lower()} with data.packing={packing} (or data.packing=none)")
        if p.cp > 1 and s.kind != "slimpipe":
            why = "schedule.kind=slimpipe, whose query-out CP attention keeps to each window's documents"
            raise fail("parallel.cp", p.cp, f"1 with data.packing={packing} and schedule.kind={s.kind} (or {why})")
        if len(self.data.path) > 1:
            raise fail("data.path", list(self.data.path), f"one prefix with data.packing={packing} (no blend)")
        if self.cp_routes and p.tp > 1:  # CP-routed windows under TP are not checked end to end
            raise fail("parallel.tp", p.tp, "1 with data.packing=slimpack and cp.engine=zeppelin (or cp.engine=ring)")

    def _check_recompute_depth(self) -> None:
        """Megatron checkpoints within a chunk's layers: ``block`` N of them, ``uniform`` groups of N
        (its loop indexes past the chunk's last layer unless N divides the layer count)."""
        t, m, p = self.train, self.model, self.parallel
        if t.recompute_num_layers is None:
            return
        counts = p.layers_per_stage or (m.num_layers // (p.pp * p.vpp),)
        layers = min(counts)
        n = t.recompute_num_layers
        if t.recompute_method == "block" and n > layers:
            raise fail("train.recompute_num_layers", n, f"an integer in [1, {layers}] (layers per pipeline chunk)")
        if t.recompute_method != "block" and any(c % n for c in counts):
            divisors = [d for d in range(1, layers + 1) if all(c % d == 0 for c in counts)]
            distinct = sorted(set(counts))
            held = (
                f"the {layers} layers per pipeline chunk" if len(distinct) == 1 else f"every stage's layers {distinct}"
            )
            raise fail(
                "train.recompute_num_layers",
                n,
                f"with recompute_method=uniform, a divisor of {held}: {divisors}",
            )

    @property
    def slice_alignment(self) -> int:
        """Every slice boundary is a multiple of this many tokens (zigzag CP chunks, SP shards)."""
        p = self.parallel
        return slice_alignment(p.cp, p.tp, p.sequence_parallel)

    @property
    def query_out_cp(self) -> bool:
        """Train runs SlimPipe's query-out CP, no engine: packed windows (slimpipe only), or ``exchange_cp``."""
        return self.parallel.cp > 1 and (self.data.packing != "none" or self.exchange_cp)

    @property
    def exchange_cp(self) -> bool:
        """Context exchange under CP: plain causal windows split zigzag-wise (named by ``cp.engine=ring``)."""
        p, s = self.parallel, self.schedule
        sliced = s.kind == "slimpipe" and s.num_slices > 1
        return p.cp > 1 and sliced and s.slice_policy == "exchange" and self.data.packing == "none"

    @property
    def cp_routes(self) -> bool:
        """SlimPack CP-routes outliers and train runs them under Zeppelin's placement (docs/packing.md)."""
        return self.query_out_cp and self.data.packing == "slimpack" and self.cp.engine == "zeppelin"

    @property
    def dp_merge(self) -> bool:
        """SlimPack may split an outlier over two DP replicas and train runs it (``pack/dp_merge.py``)."""
        return merge_runs(self)

    @property
    def num_microbatches(self) -> int:
        return self.train.global_batch_size // (self.train.micro_batch_size * self.parallel.dp)

    @cached_property
    def hardware_profile(self) -> HardwareProfile:
        return load_hardware(self.hardware)

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = to_dict(self)
        return data


def available_recipes() -> list[str]:
    return sorted(p.stem for p in config_dir().glob("*.yaml"))


def recipe_path(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise ConfigError(f"--recipe: file {name_or_path!r} does not exist")
        return path
    candidate = config_dir() / f"{name_or_path}.yaml"
    if not candidate.is_file():
        raise ConfigError(
            f"--recipe: unknown recipe {name_or_path!r} (allowed: {', '.join(available_recipes()) or 'none found'} "
            f"in {config_dir()}, or a path to a .yaml file)"
        )
    return candidate


def load_recipe(name_or_path: str, overrides: Optional[list[str]] = None) -> Recipe:
    path = recipe_path(name_or_path)
    data = load_yaml_mapping(path, f"--recipe {path}")
    data.setdefault("name", path.stem)
    data = apply_overrides(data, list(overrides or []), Recipe)
    return recipe_from_dict(data)


def recipe_from_dict(data: dict[str, Any]) -> Recipe:
    return build(Recipe, data)
