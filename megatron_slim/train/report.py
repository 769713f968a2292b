"""What one rank of ``megatron-slim train`` is asked to do (``TrainOptions``) and what it reports back
(``RankReport``) to ``commands/train.py``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megatron_slim.train.metrics import MetricsOptions
from megatron_slim.train.profiler import ProfileOptions


@dataclass(frozen=True)
class TrainOptions:
    checkpoint_dir: Optional[str] = None
    resume: bool = True
    resume_from: Optional[int] = None  # the iteration checkpoint.check_resumable chose before any work
    exit_interval: int = 0  # stop (with a checkpoint) after this iteration, as if interrupted
    measure_memory: bool = True
    quiet: bool = False
    metrics: Optional[MetricsOptions] = None  # --tensorboard-dir / --wandb-project
    profile: Optional[ProfileOptions] = None  # --profile
    migrations: tuple = ()  # DynMo: (iteration, layers per stage) pairs, moved live after it (train.dynmo)


@dataclass
class RankReport:
    rank: int
    pp_rank: int
    dp_rank: int
    tp_rank: int
    cp_rank: int = 0
    losses: list = field(default_factory=list)  # (iteration, loss) on the reporting rank
    iteration_seconds: list = field(default_factory=list)
    peak_activation_bytes: int = 0
    peak_kv_bytes: int = 0
    offloaded_bytes: int = 0  # activation bytes one iteration moved to host memory (train.offload_ratio)
    peak_p2p_bytes: int = 0
    exchanged_tokens: int = 0  # K/V tokens one iteration shipped to context-exchange peers (all layers)
    resumed_from: Optional[int] = None
    last_iteration: int = 0
    attention_backend: str = ""
    schedule_digest: str = ""
    skipped_steps: int = 0
    skipped_iterations: list = field(default_factory=list)
    stopped: str = ""  # why training stopped early (a non-finite loss or gradient norm); "" = it did not
    cp_iterations: list = field(default_factory=list)  # per iteration: train.cp.CPTrainStep.summary()
    dynmo: dict = field(default_factory=dict)  # DynamicTraining.after: layer profile, frozen layers, exits
    packing: list = field(default_factory=list)  # per iteration (data.packing): IterationPacking.record()
