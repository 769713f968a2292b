"""What the start-up rules read, whoever asks: a neutral view of a run's settings, and each
caller's names for them.

The launcher builds a ``Settings`` from Megatron-LM's parsed flags (``megatron.args``),
``megatron-slim train`` and ``megatron-args`` from a recipe (``plan.startup.from_recipe``). A rule
names the inputs through ``Inputs``, so one message reads ``--micro-batch-size 1`` to the launcher
and ``train.micro_batch_size=1`` to a recipe. Imports no torch and no megatron.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from megatron_slim.plan.recipe_sections import MEGATRON_CP_ENGINE

NO_CP_ENGINE = "te"  # Megatron's own context parallelism: no megatron-slim engine runs
# ... and a recipe's name for it, which megatron-slim train's view keeps so its rule can refuse it
_NO_ENGINE = (None, NO_CP_ENGINE, MEGATRON_CP_ENGINE)


# from here pretrain_gpt.get_batch hands the last pipeline stage labels and loss mask only (no tokens)
TOKENLESS_LAST_STAGE_MEGATRON_CORE = (0, 18)


def last_stage_reads_tokens(megatron_core: Optional[tuple[int, int]]) -> bool:
    """Whether ``pretrain_gpt.py``'s last pipeline stage gets the tokens (and position ids) it reads
    under megatron-core ``megatron_core`` (major, minor); None (not known) counts as yes."""
    return megatron_core is None or megatron_core < TOKENLESS_LAST_STAGE_MEGATRON_CORE


@dataclass(frozen=True)
class Settings:
    """The settings the start-up rules read; what a caller cannot express keeps its default."""

    cp: int = 1
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    micro_batch_size: int = 1
    sequence_parallel: bool = False
    cp_engine: str = NO_CP_ENGINE
    cp_remap: bool = False
    slimpipe: bool = False
    num_slices: int = 1
    slice_policy: str = "uniform"
    vocab_parallel: bool = False
    seq_length: int = 0
    recompute: Optional[str] = None  # the recomputation granularity ("full", "selective"); None: none
    recompute_modules: tuple[str, ...] = ()  # what selective recomputation checkpoints
    recompute_method: Optional[str] = None  # under full recomputation: "uniform" or "block"
    precision: str = "fp32"
    eval_iters: int = 0
    offload_ratio: float = 0.0  # SlimPipe's per-slice activation offload (not a Megatron-LM flag)
    # Megatron-LM flags a recipe has no field for
    hierarchical_cp_sizes: Any = None
    cp_comm_type: Any = None
    hybrid_cp: bool = False
    partial_checkpoints: Optional[int] = None
    reset_attention_mask: bool = False
    reset_position_ids: bool = False
    num_experts: Optional[int] = None
    multi_latent_attention: bool = False
    cuda_graph_impl: Optional[str] = None
    enable_cuda_graph: bool = False
    external_cuda_graph: bool = False
    mtp_num_layers: Optional[int] = None
    sequence_packing: bool = False
    position_embedding: Optional[str] = None
    attention_dropout: float = 0.0
    # the launcher's --slimpipe-packing and what it needs of Megatron-LM's loop
    packing: str = "none"
    per_token_loss: bool = False
    dataloader_type: Optional[str] = None
    # the installed megatron-core (major, minor) under the launcher; None: not known (train, megatron-args)
    megatron_core: Optional[tuple[int, int]] = None

    @property
    def cp_engine_runs(self) -> bool:
        """A megatron-slim CP engine runs the attention (SlimPipe brings its own CP attention)."""
        return self.cp_engine not in _NO_ENGINE and self.cp > 1 and not self.slimpipe

    @property
    def cp_engine_slices(self) -> bool:
        """SlimPipe slices follow a CP engine's plan of each window (``docs/cp-pipeline.md``)."""
        return self.cp_engine not in _NO_ENGINE and self.cp > 1 and self.slimpipe

    @property
    def cuda_graphs(self) -> bool:
        return self.cuda_graph_impl not in (None, "none") or self.enable_cuda_graph or self.external_cuda_graph


@dataclass(frozen=True)
class Inputs:
    """How one caller names the inputs behind ``Settings`` fields: Megatron-LM flags or recipe fields."""

    caller: str
    names: dict[str, str]

    @property
    def flags(self) -> bool:
        return self.caller == LAUNCHER

    def name(self, key: str) -> str:
        return self.names[key]

    def setting(self, key: str, value: Any) -> str:
        """``--cp-engine zeppelin`` / ``--cp-remap`` for flags; ``cp.engine=zeppelin`` for a recipe."""
        name = self.names[key]
        if self.flags:
            return name if value is True else f"{name} {value}"
        if "=" in name:  # a field whose value says it (schedule.kind=slimpipe)
            return name
        return f"{name}={str(value).lower() if isinstance(value, bool) else value}"

    def unset(self, key: str, off: str) -> str:
        """What turns ``key`` off: drop the flag, or set the recipe field to ``off``."""
        return f"drop {self.names[key]}" if self.flags else f"{self.names[key]}={off}"


LAUNCHER = "launcher"  # Megatron-LM's flags, checked inside validate_args
TRAIN = "train"  # megatron-slim train, on a recipe
MEGATRON_ARGS = "megatron-args"  # a recipe turned into Megatron-LM flags

_RECIPE_NAMES = {
    "cp": "parallel.cp",
    "tp": "parallel.tp",
    "pp": "parallel.pp",
    "vpp": "parallel.vpp",
    "micro_batch_size": "train.micro_batch_size",
    "sequence_parallel": "parallel.sequence_parallel",
    "cp_engine": "cp.engine",
    "cp_remap": "cp.remap",
    "slimpipe": "schedule.kind=slimpipe",
    "num_slices": "schedule.num_slices",
    "slice_policy": "schedule.slice_policy",
    "vocab_parallel": "schedule.vocab_parallel",
    "seq_length": "model.seq_length",
    "recompute": "train.recompute",
    "recompute_method": "train.recompute_method",
    "precision": "train.precision",
    "eval_iters": "train.eval_iters",
    "offload_ratio": "train.offload_ratio",
    "megatron_schedule": "schedule.kind=1f1b or interleaved",
    "packing": "data.packing",
}
_FLAG_NAMES = {
    "cp": "--context-parallel-size",
    "tp": "--tensor-model-parallel-size",
    "pp": "--pipeline-model-parallel-size",
    "vpp": "--virtual-pipeline-model-parallel-size",
    "micro_batch_size": "--micro-batch-size",
    "sequence_parallel": "--sequence-parallel",
    "cp_engine": "--cp-engine",
    "cp_remap": "--cp-remap",
    "slimpipe": "--use-slimpipe",
    "num_slices": "--slimpipe-num-slices",
    "slice_policy": "--slimpipe-slice-policy",
    "vocab_parallel": "--slimpipe-vocab-parallel",
    "seq_length": "--seq-length",
    "recompute": "--recompute-granularity",
    "recompute_method": "--recompute-method",
    "offload_ratio": "--slimpipe-offload-ratio",
    "precision": "--bf16 or --fp16",
    "megatron_schedule": "no --use-slimpipe",
    "packing": "--slimpipe-packing",
}
INPUTS = {
    LAUNCHER: Inputs(LAUNCHER, _FLAG_NAMES),
    TRAIN: Inputs(TRAIN, _RECIPE_NAMES),
    MEGATRON_ARGS: Inputs(MEGATRON_ARGS, _RECIPE_NAMES),
}
