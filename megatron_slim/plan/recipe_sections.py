"""The sections of a recipe (``model``, ``parallel``, ``train``, ``schedule``, ``cp``, ``data``): frozen
dataclasses that each check their own fields. Rules spanning sections live on ``Recipe``
(``megatron_slim.plan.recipe``), which re-exports these names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal, Optional

from megatron_slim.plan.recompute import DEFAULT_RECOMPUTE_MODULES, RECOMPUTE_MODULES, Granularity, Method, Recompute
from megatron_slim.plan.schema import ConfigError, check_fields, fail

ScheduleKind = Literal["1f1b", "interleaved", "slimpipe"]
SlicePolicy = Literal["uniform", "balanced", "exchange"]
CPEngine = Literal["ring", "zeppelin", "ulysses", "a2a+p2p", "allgather", "dynamic", "megatron"]
# Megatron-LM's own context parallelism (Transformer Engine's p2p ring, zigzag per window): what
# megatron-args launches with no --cp-engine, the attention the 1f1b/interleaved cost model prices
MEGATRON_CP_ENGINE: Final = "megatron"
# engines whose plans ``megatron-slim train`` runs slice by slice under SlimPipe (plan/cp/slices.py)
SLICED_CP_ENGINES = ("zeppelin", "ring", "ulysses")
Packing = Literal["none", "slimpack", "megatron", "bfd"]


def _require_positive(section: str, obj: object, names: tuple[str, ...]) -> None:
    check_fields(obj, f"{section}.", names, lambda value: value < 1, "an integer >= 1")


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
        _require_positive(
            "model",
            self,
            (
                "num_layers",
                "hidden_size",
                "ffn_hidden_size",
                "num_attention_heads",
                "num_query_groups",
                "vocab_size",
                "seq_length",
            ),
        )
        if self.hidden_size % self.num_attention_heads:
            raise fail(
                "model.num_attention_heads",
                self.num_attention_heads,
                f"a divisor of model.hidden_size={self.hidden_size}",
            )
        if self.num_attention_heads % self.num_query_groups:
            raise fail(
                "model.num_query_groups",
                self.num_query_groups,
                f"a divisor of model.num_attention_heads={self.num_attention_heads}",
            )
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
    # layers of each pipeline stage, in order (a DynMo split); empty: Megatron's even split
    layers_per_stage: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _require_positive("parallel", self, ("tp", "pp", "vpp", "cp", "dp"))
        _check_layers_per_stage(self)
        if self.sequence_parallel and self.tp == 1:
            raise fail("parallel.sequence_parallel", True, "false when parallel.tp=1")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp


def _check_layers_per_stage(p: ParallelConfig) -> None:
    split = p.layers_per_stage
    if not split:
        return
    if len(split) != p.pp or min(split) < 1:
        raise fail(
            "parallel.layers_per_stage", list(split), f"{p.pp} integers >= 1 (one per stage, parallel.pp={p.pp})"
        )
    if p.vpp != 1:
        raise fail("parallel.layers_per_stage", list(split), "[] (the even split) when parallel.vpp > 1")


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
    # Megatron's --recompute-granularity/-method/-num-layers/-modules (see plan/recompute.py);
    # unset method and layer count under full mean uniform, 1 layer
    recompute: Granularity = "none"
    recompute_method: Optional[Method] = None
    recompute_num_layers: Optional[int] = None
    recompute_modules: Optional[tuple[str, ...]] = None  # selective only; unset: core_attn
    offload_ratio: float = 0.0  # share of each slice's saved layer activations kept in host memory
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
        counts = ("warmup_iters", "save_interval", "eval_interval", "eval_iters")
        check_fields(self, "train.", counts, lambda value: value < 0, "an integer >= 0")

        if self.clip_grad < 0:
            raise fail("train.clip_grad", self.clip_grad, "a number >= 0 (0 disables clipping)")
        if self.weight_decay < 0:
            raise fail("train.weight_decay", self.weight_decay, "a number >= 0")
        if not 0 <= self.seed <= MAX_SEED:
            raise fail("train.seed", self.seed, f"an integer in [0, {MAX_SEED}] (numpy's seed range)")
        self._check_recompute()

    def _check_recompute(self) -> None:
        full, selective = self.recompute == "full", self.recompute == "selective"
        if self.recompute_method is not None and not full:
            raise fail("train.recompute_method", self.recompute_method, "unset unless train.recompute=full")
        if self.recompute_num_layers is not None:
            if not full:
                raise fail("train.recompute_num_layers", self.recompute_num_layers, "unset unless train.recompute=full")
            if self.recompute_num_layers < 1:
                raise fail("train.recompute_num_layers", self.recompute_num_layers, "an integer >= 1")
        if self.recompute_modules is not None:
            if not selective:
                modules = list(self.recompute_modules)
                raise fail("train.recompute_modules", modules, "unset unless train.recompute=selective")
            unknown = [m for m in self.recompute_modules if m not in RECOMPUTE_MODULES]
            if unknown or not self.recompute_modules:
                raise fail(
                    "train.recompute_modules",
                    list(self.recompute_modules),
                    f"a non-empty list of Megatron-LM's --recompute-modules: {', '.join(RECOMPUTE_MODULES)}",
                    f"unknown module {unknown[0]!r}" if unknown else "empty list",
                )
        if not 0.0 <= self.offload_ratio <= 1.0:
            raise fail("train.offload_ratio", self.offload_ratio, "a fraction in [0, 1]")

    @property
    def recompute_plan(self) -> Recompute:
        """The recomputation and offloading settings, normalised (defaults filled in)."""
        return Recompute(
            self.recompute,
            self.recompute_method or "uniform",
            self.recompute_num_layers or 1,
            (self.recompute_modules or DEFAULT_RECOMPUTE_MODULES) if self.recompute == "selective" else (),
            self.offload_ratio,
        )


@dataclass(frozen=True)
class ScheduleConfig:
    kind: ScheduleKind = "1f1b"
    num_slices: int = 1
    slice_policy: SlicePolicy = "uniform"
    # The embedding and output layer spread over all pipeline ranks: simulated (plan/cost/vocab.py) and
    # run by megatron-slim train (docs/vocab-parallel.md); refused by the Megatron-LM launcher.
    vocab_parallel: bool = False

    def __post_init__(self) -> None:
        _require_positive("schedule", self, ("num_slices",))


@dataclass(frozen=True)
class CPConfig:
    """How context-parallel attention runs (only consulted when parallel.cp > 1 or for CP simulation)."""

    engine: CPEngine = "ring"
    remap: bool = False

    def __post_init__(self) -> None:
        if self.remap and self.engine == MEGATRON_CP_ENGINE:
            raise fail(
                "cp.remap",
                True,
                f"false with cp.engine={MEGATRON_CP_ENGINE} (Megatron-LM's own CP has no remapping layer; "
                "cp.engine=zeppelin has one)",
            )


@dataclass(frozen=True)
class DataConfig:
    """Training data for ``megatron-slim train``: a corpus tokenized into megatron-core's indexed format,
    or existing Megatron data (``path``, as ``--data-path``) with the tokenizer it was written with."""

    corpus: str = "stdlib"  # "stdlib" (the Python standard library's sources) or a directory of text files
    cache_dir: str = ""  # where the tokenizer and indexed dataset are written; "" = ~/.cache/megatron-slim
    max_files: int = 0  # 0 = every file found
    path: tuple[str, ...] = ()  # Megatron --data-path: a prefix, or weight/prefix pairs; replaces corpus
    tokenizer: str = ""  # a Hugging Face tokenizer dir or tokenizer.json; "" = train one on the corpus
    # none: GPTDataset's fixed windows; else whole documents packed per iteration (docs/packing.md)
    packing: Packing = "none"

    def __post_init__(self) -> None:
        if self.max_files < 0:
            raise fail("data.max_files", self.max_files, "an integer >= 0 (0: every file)")
        if self.path and self.corpus != "stdlib":
            raise ConfigError(
                f"data.corpus: {self.corpus!r} with data.path {list(self.path)!r} (allowed: one "
                "source: data.path (existing Megatron data) or data.corpus (text to tokenize))"
            )
