"""Measure, at run time, the activation bytes each forward action leaves for its backward.

A ``saved_tensors_hooks`` pack hook sees every tensor autograd saves during a forward action.
Bytes are counted per storage (a view keeps its whole storage alive), once per storage, and
without parameters (weights saved by matmuls are static memory), K/V cache chunks (counted by
the cache store as K/V) or what an ``ActivationOffload`` moved to host memory. They are released
when the action's backward ends. This is the same accounting the simulator uses, so the two can be
compared number for number.

``InFlightBytes`` (the meter's ``p2p``) counts point-to-point buffers while they are in flight, the
spans ``plan/sim/in_flight.py`` prices: a sent slice from its send until the transfer is found
complete, a received one from its receive until the compute that consumes it starts.
"""

from __future__ import annotations

import contextlib
from typing import Hashable, Iterable, Optional

import torch

from megatron_slim.runtime.pipeline.offload import ActivationOffload


class InFlightBytes:
    def __init__(self) -> None:
        self._held: dict[Hashable, tuple[int, bool]] = {}  # key -> (bytes, received)
        self.live_bytes = self.peak_bytes = 0
        self.live_recv_bytes = self.peak_recv_bytes = 0

    def add(self, key: Hashable, nbytes: int, received: bool) -> None:
        self._held[key] = (nbytes, received)
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        if received:
            self.live_recv_bytes += nbytes
            self.peak_recv_bytes = max(self.peak_recv_bytes, self.live_recv_bytes)

    def remove(self, key: Hashable) -> None:
        """``key``'s buffer is no longer in flight (no-op for a key never added)."""
        nbytes, received = self._held.pop(key, (0, False))
        self.live_bytes -= nbytes
        if received:
            self.live_recv_bytes -= nbytes


class ActivationMeter:
    def __init__(self, parameters: Iterable[torch.Tensor], kv_storages=lambda: set()) -> None:
        self._static = {p.untyped_storage().data_ptr() for p in parameters}
        self._kv_storages = kv_storages
        self._owned: dict[int, Hashable] = {}  # storage ptr -> action that holds it
        self._per_action: dict[Hashable, int] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self.p2p = InFlightBytes()

    @contextlib.contextmanager
    def track(self, action: Hashable, offload: Optional[ActivationOffload] = None):
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor):
            held = offload.pack(t) if offload is not None else None
            if held is not None:
                return held
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in self._static and ptr not in self._owned:
                seen[ptr] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, ActivationOffload.unpack):
            yield
        kv = self._kv_storages()
        nbytes = 0
        for ptr, size in seen.items():
            if ptr not in kv:
                self._owned[ptr] = action
                nbytes += size
        self._per_action[action] = nbytes
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def release(self, action: Hashable) -> None:
        self.live_bytes -= self._per_action.pop(action, 0)
        for ptr in [p for p, owner in self._owned.items() if owner == action]:
            del self._owned[ptr]

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes
