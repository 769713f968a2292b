"""Activation offloading: a share of each forward action's saved activations waits for its backward
in host memory instead of on the device.

Saved-tensor hooks see every tensor autograd saves. While ``active`` (the model side switches it on
around the layers it offloads), a saved tensor of at least ``min_bytes`` is copied to a host buffer
(pinned when it comes from a GPU) and only the copy is kept; backward copies it back when autograd
unpacks it. Parameters and K/V cache chunks are never moved: they stay on the device anyway. The
activation meter counts what stays (``ActivationMeter.track(..., offload=)``); ``moved_bytes`` is
what went to the host.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Optional

import torch


class OffloadedTensor:
    """A saved activation held in host memory, and the device it goes back to."""

    __slots__ = ("host", "device")

    def __init__(self, host: torch.Tensor, device: torch.device) -> None:
        self.host, self.device = host, device


class ActivationOffload:
    def __init__(
        self, parameters: Iterable[torch.Tensor], kept_storages: Callable[[], set], min_bytes: int = 1024
    ) -> None:
        self._static = {p.untyped_storage().data_ptr() for p in parameters}
        self._kept_storages = kept_storages
        self.min_bytes = min_bytes
        self.active = False
        self.moved_bytes = 0

    def pack(self, t: torch.Tensor) -> Optional[OffloadedTensor]:
        """The host copy of ``t`` if it is to be offloaded, else None (it stays where it is)."""
        nbytes = t.numel() * t.element_size()
        if not self.active or nbytes < self.min_bytes:
            return None
        ptr = t.untyped_storage().data_ptr()
        if ptr in self._static or ptr in self._kept_storages():
            return None
        on_gpu = t.device.type != "cpu"
        host = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="cpu", pin_memory=on_gpu)
        host.copy_(t.detach(), non_blocking=on_gpu)
        self.moved_bytes += nbytes
        return OffloadedTensor(host, t.device)

    @staticmethod
    def unpack(saved):
        if not isinstance(saved, OffloadedTensor):
            return saved
        if saved.device.type == "cpu":
            return saved.host
        return saved.host.to(saved.device, non_blocking=True)

    @contextlib.contextmanager
    def track(self):
        """Offload during a forward action that no activation meter watches."""

        def pack(t: torch.Tensor):
            held = self.pack(t)
            return t if held is None else held

        with torch.autograd.graph.saved_tensors_hooks(pack, self.unpack):
            yield
