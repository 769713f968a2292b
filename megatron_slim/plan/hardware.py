"""Hardware profiles: what one GPU, one node and the network can do.

Profiles live in ``megatron_slim/configs/hardware/<name>.yaml`` and cite the spec sheets they come from.
Efficiencies are the fraction of peak a kernel class reaches; a calibration file of measured
times (see ``plan/cost/calibration.py``) replaces them where a GPU has been measured. Links are
``latency + bytes / bandwidth`` per message at the full per-direction rate; what that leaves out and
where each profile's numbers come from: ``docs/cp-placement-choice.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from megatron_slim.plan.files import load_yaml_mapping
from megatron_slim.plan.paths import config_dir
from megatron_slim.plan.schema import ConfigError, build, check_fields, fail


@dataclass(frozen=True)
class Efficiency:
    """Achieved fraction of the datasheet rate per kernel class."""

    gemm: float = 0.75
    attention_forward: float = 0.65
    attention_backward: float = 0.50
    memory_bound: float = 0.80  # fraction of HBM bandwidth for norms, RoPE, SwiGLU, adds

    def __post_init__(self) -> None:
        kernels = ("gemm", "attention_forward", "attention_backward", "memory_bound")
        check_fields(self, "efficiency.", kernels, lambda value: not 0.0 < value <= 1.0, "a fraction in (0, 1]")


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    peak_bf16_flops: float
    hbm_bytes: int
    hbm_bandwidth: float
    gpus_per_node: int
    nics_per_node: int
    nvlink_bandwidth: float  # bytes/s per GPU per direction
    nvlink_latency: float  # seconds
    nic_bandwidth: float  # bytes/s per NIC per direction
    nic_latency: float  # seconds
    efficiency: Efficiency = field(default_factory=Efficiency)
    # Host link for activation offloading, bytes/s per GPU per direction. Default: PCIe Gen5 x16,
    # 64 GB/s per direction (H100 SXM datasheet: 128 GB/s bidirectional); a spec figure, not measured.
    pcie_bandwidth: float = 64.0e9
    usable_memory_fraction: float = 0.92  # CUDA context, NCCL buffers, allocator fragmentation
    # Which megatron-core layer implementation runs here; it decides what a layer saves for
    # backward: "te" (Transformer Engine fused norm+linear, fused SwiGLU and RoPE) on GPU clusters,
    # "local" (megatron-core's local spec: torch RMSNorm, unfused SwiGLU and RoPE) on CPU ranks.
    layer_impl: Literal["te", "local"] = "te"

    def __post_init__(self) -> None:
        positive = (
            "peak_bf16_flops",
            "hbm_bytes",
            "hbm_bandwidth",
            "gpus_per_node",
            "nics_per_node",
            "nvlink_bandwidth",
            "nic_bandwidth",
            "pcie_bandwidth",
        )
        check_fields(self, "", positive, lambda value: value <= 0, "a positive number")
        latencies = ("nvlink_latency", "nic_latency")
        check_fields(self, "", latencies, lambda value: value < 0, "a non-negative number of seconds")
        if not 0.0 < self.usable_memory_fraction <= 1.0:
            raise fail("usable_memory_fraction", self.usable_memory_fraction, "a fraction in (0, 1]")

    @property
    def usable_hbm_bytes(self) -> int:
        return int(self.hbm_bytes * self.usable_memory_fraction)


def available_profiles() -> list[str]:
    return sorted(p.stem for p in (config_dir() / "hardware").glob("*.yaml"))


def load_hardware(name_or_path: str) -> HardwareProfile:
    path = Path(name_or_path)
    if not path.suffix:
        path = config_dir() / "hardware" / f"{name_or_path}.yaml"
    if not path.is_file():
        raise ConfigError(
            f"hardware: unknown profile {name_or_path!r} (allowed: {', '.join(available_profiles()) or 'none found'} "
            f"in {config_dir() / 'hardware'}, or a path to a profile YAML)"
        )
    data = load_yaml_mapping(path, f"hardware {path}")
    return build(HardwareProfile, data, "hardware")
