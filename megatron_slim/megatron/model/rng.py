"""Model-parallel RNG seeding that works on CPU.

megatron-core's ``model_parallel_cuda_manual_seed`` fills its RNG tracker with CUDA generator
states (``torch.cuda.get_rng_state``), which fails on a CPU-only torch. Megatron code forks that
tracker around dropout in tensor-parallel regions (and around the embedding dropout under sequence
parallelism), so on CPU we install a tracker with the same names and seeds whose states are CPU
generator states and whose ``fork`` swaps the CPU default generator.

Activation recomputation (megatron's ``CheckpointFunction``, ``CheckpointWithoutOutput``) saves and
restores the CUDA generator state next to the CPU one and the tracker's; without CUDA the CUDA part
is made an empty state (``checkpoint_rng_without_cuda``, run by ``init_model_parallel``), so
megatron's own recomputation runs on CPU.

Seeds follow megatron's scheme, so a CPU run and a GPU run draw from comparably seeded streams:
data-parallel state ``seed``, tensor-parallel state ``seed + 2718 + tp_rank``, expert state
``seed + 1024 + 100 * ep_rank + etp_rank``. Weight initialisation in
:mod:`megatron_slim.megatron.model.weights` does not use these streams at all (it seeds per parameter).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

import torch

_DEFAULT_NAMES = {
    "data": "data-parallel-rng",
    "model": "model-parallel-rng",
    "expert": "expert-parallel-rng",
}


def _random_module():
    from megatron.core.tensor_parallel import random

    return random


def _tracker_names() -> dict[str, str]:
    random = _random_module()
    return {
        "data": getattr(random, "_DATA_PARALLEL_RNG_TRACKER_NAME", _DEFAULT_NAMES["data"]),
        "model": getattr(random, "_MODEL_PARALLEL_RNG_TRACKER_NAME", _DEFAULT_NAMES["model"]),
        "expert": getattr(random, "_EXPERT_PARALLEL_RNG_TRACKER_NAME", _DEFAULT_NAMES["expert"]),
    }


@functools.cache
def _cpu_tracker_class():
    base: Any = _random_module().CudaRNGStatesTracker

    class CpuRNGStatesTracker(base):
        """megatron's RNG tracker with CPU generator states (same interface, same names)."""

        def add(self, name: str, seed: int) -> None:
            if seed in self.seeds_:
                raise ValueError(f"seed {seed} already exists")
            if name in self.states_:
                raise ValueError(f"rng state {name!r} already exists")
            self._is_initialized = True
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name: str = _tracker_names()["model"]) -> Iterator[None]:
            if name not in self.states_:
                raise KeyError(f"rng state {name!r} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    return CpuRNGStatesTracker


def seed_model_parallel_rng(
    seed: int, *, tp_rank: int = 0, ep_rank: int = 0, etp_rank: int = 0, device: str = "cpu"
) -> None:
    """Seed torch and megatron's model-parallel RNG tracker for this rank.

    ``device="cuda"`` defers to megatron's own ``model_parallel_cuda_manual_seed``.
    """
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed={seed!r}: allowed values are integers >= 0")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: allowed values are 'cpu', 'cuda'")
    torch.manual_seed(seed)
    random = _random_module()
    if device == "cuda":
        random.model_parallel_cuda_manual_seed(seed)
        return
    names = _tracker_names()
    tracker = _cpu_tracker_class()()
    tracker.add(names["data"], seed)
    tracker.add(names["model"], seed + 2718 + tp_rank)
    tracker.add(names["expert"], seed + 1024 + 100 * ep_rank + etp_rank)
    random._CUDA_RNG_STATE_TRACKER = tracker
    random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    checkpoint_rng_without_cuda()


def checkpoint_rng_without_cuda() -> None:
    """Megatron's checkpoint functions read and set the CUDA generator state unconditionally; on a
    torch without CUDA there is none, so reading gives an empty state and setting does nothing."""
    if torch.cuda.is_available():
        return
    random = _random_module()

    def get_state(*args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def set_state(*args: Any, **kwargs: Any) -> None:
        return None

    random._get_cuda_rng_state, random._set_cuda_rng_state = get_state, set_state


def reset_rng_tracker() -> None:
    """Drop the installed tracker; megatron creates a fresh (empty) one on next use."""
    random = _random_module()
    random._CUDA_RNG_STATE_TRACKER = None
    random._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
