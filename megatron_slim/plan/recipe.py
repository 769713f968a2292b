"""Recipes: validated, frozen descriptions of a training run (model, parallelism, schedule, hardware).

A recipe is YAML in ``megatron_slim/configs/<name>.yaml`` (``paths.config_dir()``); ``load_recipe``
builds it, applies ``--set`` overrides and checks every cross-field rule before any work starts.
Megatron-LM flags are derived from a recipe (``megatron_slim.megatron.launch.args``), never written twice.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Literal, Optional

from megatron_slim.plan.cost.slicing import max_slices, slice_alignment, splits_aligned, splits_uniformly
from megatron_slim.plan.files import load_yaml_mapping
from megatron_slim.plan.hardware import HardwareProfile, load_hardware
from megatron_slim.plan.paths import config_dir
from megatron_slim.plan.schema import ConfigError, apply_overrides, build, fail, parse_override, to_dict

ScheduleKind = Literal["1f1b", "interleaved", "slimpipe"]
SlicePolicy = Literal["uniform", "balanced"]
CPEngine = Literal["ring", "zeppelin", "ulysses", "a2a+p2p", "allgather", "dynamic"]


def _require_positive(section: str, obj: object, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(obj, name)
        if value < 1:
            raise fail(f"{section}.{name}", value, "an integer >= 1")


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-style decoder: RoPE, RMSNorm, SwiGLU MLP, grouped-query attention."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    vocab_size: int
    seq_length: int
    name: str = ""
    rotary_base: float = 10000.0
    norm_epsilon: float = 1e-5
    untie_embeddings_and_output_weights: bool = True

    def __post_init__(self) -> None:
        _require_positive("model", self, (
            "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
            "num_query_groups", "vocab_size", "seq_length",
        ))
        if self.hidden_size % self.num_attention_heads:
            raise fail("model.num_attention_heads", self.num_attention_heads,
                       f"a divisor of model.hidden_size={self.hidden_size}")
        if self.num_attention_heads % self.num_query_groups:
            raise fail("model.num_query_groups", self.num_query_groups,
                       f"a divisor of model.num_attention_heads={self.num_attention_heads}")
        if self.rotary_base <= 1:  # RoPE's frequencies are base**(-2i/d): base <= 1 does not rotate
            raise fail("model.rotary_base", self.rotary_base, "a number > 1 (Llama: 10000 or 500000)")
        if not 0 < self.norm_epsilon < 1:
            raise fail("model.norm_epsilon", self.norm_epsilon, "a number in (0, 1) (Llama: 1e-5 or 1e-6)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    dp: int = 1
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        _require_positive("parallel", self, ("tp", "pp", "vpp", "cp", "dp"))
        if self.sequence_parallel and self.tp == 1:
            raise fail("parallel.sequence_parallel", True, "false when parallel.tp=1")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp


MAX_SEED = 2**32 - 1


@dataclass(frozen=True)
class TrainConfig:
    global_batch_size: int
    micro_batch_size: int = 1
    iters: int = 10
    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup_iters: int = 0
    weight_decay: float = 0.1
    clip_grad: float = 1.0
    seed: int = 1234
    precision: Literal["bf16", "fp32"] = "bf16"
    recompute: Literal["none", "full"] = "none"
    distributed_optimizer: bool = True
    save_interval: int = 0  # 0: save once, at the end of training
    log_interval: int = 1
    eval_interval: int = 0  # 0: evaluate once, at the end of training (when eval_iters > 0)
    eval_iters: int = 0  # microbatch rounds per evaluation; 0: no evaluation
    # false (Megatron's --check-for-nan-in-loss-and-grad): a nan/inf loss or grad norm stops training
    skip_nonfinite_steps: bool = False

    def __post_init__(self) -> None:
        _require_positive("train", self, ("global_batch_size", "micro_batch_size", "iters", "log_interval"))
        if self.lr <= 0:
            raise fail("train.lr", self.lr, "a positive number")
        if not 0 <= self.min_lr <= self.lr:
            raise fail("train.min_lr", self.min_lr, f"a number in [0, train.lr={self.lr}]")
        for name in ("warmup_iters", "save_interval", "eval_interval", "eval_iters"):
            if getattr(self, name) < 0:
                raise fail(f"train.{name}", getattr(self, name), "an integer >= 0")

        if self.clip_grad < 0:
            raise fail("train.clip_grad", self.clip_grad, "a number >= 0 (0 disables clipping)")
        if self.weight_decay < 0:
            raise fail("train.weight_decay", self.weight_decay, "a number >= 0")
        if not 0 <= self.seed <= MAX_SEED:
            raise fail("train.seed", self.seed, f"an integer in [0, {MAX_SEED}] (numpy's seed range)")


@dataclass(frozen=True)
class ScheduleConfig:
    kind: ScheduleKind = "1f1b"
    num_slices: int = 1
    slice_policy: SlicePolicy = "uniform"

    def __post_init__(self) -> None:
        _require_positive("schedule", self, ("num_slices",))


@dataclass(frozen=True)
class CPConfig:
    """How context-parallel attention runs (only consulted when parallel.cp > 1 or for CP simulation)."""

    engine: CPEngine = "ring"
    remap: bool = False


@dataclass(frozen=True)
class DataConfig:
    """Training data for ``megatron-slim train``: a corpus tokenized into megatron-core's indexed format,
    or existing Megatron data (``path``, as ``--data-path``) with the tokenizer it was written with."""

    corpus: str = "stdlib"  # "stdlib" (the Python standard library's sources) or a directory of text files
    cache_dir: str = ""  # where the tokenizer and indexed dataset are written; "" = ~/.cache/megatron-slim
    max_files: int = 0  # 0 = every file found
    path: tuple[str, ...] = ()  # Megatron --data-path: a prefix, or weight/prefix pairs; replaces corpus
    tokenizer: str = ""  # a Hugging Face tokenizer dir or tokenizer.json; "" = train one on the corpus

    def __post_init__(self) -> None:
        if self.max_files < 0:
            raise fail("data.max_files", self.max_files, "an integer >= 0 (0: every file)")
        if self.path and self.corpus != "stdlib":
            raise ConfigError(f"data.corpus: {self.corpus!r} with data.path {list(self.path)!r} (allowed: one "
                              "source: data.path (existing Megatron data) or data.corpus (text to tokenize))")


@dataclass(frozen=True)
class Recipe:
    model: ModelConfig
    train: TrainConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    cp: CPConfig = field(default_factory=CPConfig)
    data: DataConfig = field(default_factory=DataConfig)
    hardware: str = "h100"
    name: str = ""
    description: str = ""

    def __post_init__(self) -> None:
        self._check_parallel_fits_model()
        self._check_batch()
        self._check_schedule()
        _ = self.hardware_profile  # an unknown profile fails here, before any work

    def _check_parallel_fits_model(self) -> None:
        m, p = self.model, self.parallel
        chunks = p.pp * p.vpp
        if m.num_layers % chunks:
            field_name = "parallel.vpp" if p.vpp > 1 and m.num_layers % p.pp == 0 else "parallel.pp"
            raise fail(field_name, getattr(p, field_name.split(".")[1]),
                       f"values with pp*vpp dividing model.num_layers={m.num_layers} "
                       f"(now pp*vpp={chunks})")
        if m.num_attention_heads % p.tp:
            raise fail("parallel.tp", p.tp, f"a divisor of model.num_attention_heads={m.num_attention_heads}")
        if m.num_query_groups % p.tp:
            raise fail("parallel.tp", p.tp, f"a divisor of model.num_query_groups={m.num_query_groups}")
        if m.ffn_hidden_size % p.tp:
            raise fail("parallel.tp", p.tp, f"a divisor of model.ffn_hidden_size={m.ffn_hidden_size}")
        if p.cp > 1 and m.seq_length % (2 * p.cp):
            raise fail("model.seq_length", m.seq_length,
                       f"a multiple of 2*parallel.cp={2 * p.cp} (zigzag context parallelism)")

    def _check_batch(self) -> None:
        t, p = self.train, self.parallel
        per_step = t.micro_batch_size * p.dp
        if t.global_batch_size % per_step:
            raise fail("train.global_batch_size", t.global_batch_size,
                       f"a multiple of train.micro_batch_size*parallel.dp={per_step}")

    def _check_schedule(self) -> None:
        s, p, m = self.schedule, self.parallel, self.model
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
        if s.kind == "slimpipe" and p.cp > 1 and (self.cp.engine != "ring" or self.cp.remap):
            raise fail("cp.engine", self.cp.engine,
                       "ring (the default) with cp.remap=false when schedule.kind=slimpipe: SlimPipe runs context "
                       "parallelism itself, as query-out attention over its K/V cache; cp.engine selects the "
                       "engine for 1f1b/interleaved runs")
        unit = self.slice_alignment
        if s.slice_policy == "uniform":
            if not splits_uniformly(m.seq_length, s.num_slices, unit):
                raise fail("schedule.num_slices", s.num_slices,
                           f"a count whose slices divide model.seq_length={m.seq_length} into equal parts "
                           f"that are multiples of {unit} tokens (or use schedule.slice_policy=balanced)")
        elif not splits_aligned(m.seq_length, s.num_slices, unit):
            raise fail("schedule.num_slices", s.num_slices,
                       f"at most model.seq_length/{unit}={max_slices(m.seq_length, unit)} slices, with "
                       f"model.seq_length a multiple of {unit}")

    @property
    def slice_alignment(self) -> int:
        """Every slice boundary is a multiple of this many tokens (zigzag CP chunks, SP shards)."""
        p = self.parallel
        return slice_alignment(p.cp, p.tp, p.sequence_parallel)

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


def world_size_note(name_or_path: str, overrides: Optional[list[str]], recipe: Recipe,
                    unit: str = "GPUs") -> Optional[str]:
    """A line saying so when ``--set`` overrides change the GPU count (``tp*pp*cp*dp``) from the
    recipe file's, e.g. ``note: --set parallel.pp=8 changes the job from 64 to 128 GPUs (tp4 pp8 cp1
    dp4)``; None when they do not. Overrides keep every other key as written (``parallel.dp``
    included), so a larger pp means more GPUs, not fewer data-parallel replicas: the note also says
    which ``parallel.dp`` would keep the original count, when one would."""
    if not overrides:
        return None
    path = recipe_path(name_or_path)
    data = load_yaml_mapping(path, f"--recipe {path}")
    section = data.get("parallel")
    section = section if isinstance(section, dict) else {}
    try:
        base = 1
        for key in ("tp", "pp", "cp", "dp"):
            base *= int(section.get(key, 1))
    except (TypeError, ValueError):  # the file's own value is invalid and overridden: nothing to compare with
        return None
    p = recipe.parallel
    if base == p.world_size:
        return None
    sizes = [(o.strip(), parse_override(o)[0]) for o in overrides]
    sizes = [(text, path) for text, path in sizes if path in (["parallel", k] for k in ("tp", "pp", "cp", "dp"))]
    changed = [text for text, _ in sizes]
    note = (f"note: --set {' '.join(changed)} changes the job from {base} to {p.world_size} {unit} "
            f"(tp{p.tp} pp{p.pp} cp{p.cp} dp{p.dp})")
    model_parallel = p.tp * p.pp * p.cp
    if base % model_parallel == 0 and not any(path == ["parallel", "dp"] for _, path in sizes):
        dp = base // model_parallel
        if recipe.train.global_batch_size % (recipe.train.micro_batch_size * dp) == 0:
            note += f"; parallel.dp={dp} would keep {base}"
    return note
