"""The values a SlimPipe forward-backward function carries: its settings (the slice plan and what
to measure) and what its last call measured."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

from megatron_slim.plan.recipe import Recipe


@dataclass(frozen=True)
class SlimPipeSettings:
    slice_lengths: tuple[int, ...]  # the slice plan: what the simulator was given too
    kind: str = "slimpipe"  # 1f1b and interleaved run through the same interpreter (one slice)
    attention_backend: Optional[str] = None
    measure_memory: bool = False
    offload_ratio: float = 0.0  # of each slice's decoder-layer activations, held on the host until backward
    # TP rank 0 hands each microbatch's document lengths to the other TP ranks, and the first stage
    # to stages that read no batch (--slimpipe-packing under pretrain_gpt.py with tp > 1 or pp > 2:
    # ``runtime/pipeline/stage_lengths``)
    share_documents: bool = False
    exchange: bool = False  # context exchange (schedule.slice_policy: exchange) in training calls
    # the recipe whose cost model plans the exchange blocks (``plan.sim.exchange_timing``: the one
    # ``megatron-slim simulate`` prices); None: the unit-time pairing, which needs no costs
    exchange_recipe: Optional[Recipe] = None

    @property
    def num_slices(self) -> int:
        return len(self.slice_lengths)


@dataclass
class RunStats:
    """Measured by the last call with ``measure_memory``: per model chunk on this rank."""

    peak_activation_bytes: int = 0
    peak_kv_bytes: int = 0
    offloaded_bytes: int = 0  # activation bytes the last call moved to the host (train.offload_ratio)
    peak_p2p_bytes: int = 0  # point-to-point buffers in flight (sent and received)
    exchanged_tokens: int = 0  # K/V tokens the last call moved to exchange peers, summed over layers
    served_blocks: int = 0  # attention blocks the last call computed for exchange senders (per layer)
    schedule_digest: str = ""
    agreed_digests: set = field(default_factory=set)


class ForwardBackwardFunc(Protocol):
    """Megatron's ``forward_backward_func``, carrying its run's stats and settings."""

    stats: RunStats
    settings: SlimPipeSettings

    def __call__(self, **kwargs: Any) -> list: ...


__all__ = ["ForwardBackwardFunc", "RunStats", "SlimPipeSettings"]
