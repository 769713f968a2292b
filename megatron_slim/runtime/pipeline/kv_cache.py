"""The K/V cache across slices and the dK/dV accumulation buffers.

Per (microbatch, layer) the store keeps one chunk per slice, never a concatenated copy:

* forward of slice j appends its K and V (detached; slice j's own autograd graph owns the
  gradient path) and reads chunks 0..j-1 as the prefix it attends to;
* a forward that recomputes slice j inside its backward (activation recomputation) reads the same
  prefix and appends nothing: slice j's chunk is still the newest one cached (``check_recomputed``);
* backward runs slices in reverse: slice j adds the prefix part of its dK/dV into fp32 buffers of
  chunks 0..j-1, takes the buffer of its own chunk (the sum over every later slice) and adds it to
  the gradient of its K and V; then its K/V chunk and buffer are freed: no earlier slice reads
  them. After a microbatch's last backward the store holds nothing for it.

Bytes are counted as they come and go, so a run can report the peak K/V memory it really held.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class _LayerCache:
    keys: list = field(default_factory=list)
    values: list = field(default_factory=list)
    grads: dict = field(default_factory=dict)  # slice -> (dk fp32, dv fp32)


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class ByteLedger:
    """Live and peak bytes, shareable by several stores (one per model chunk of a rank)."""

    def __init__(self) -> None:
        self.live_bytes = 0
        self.peak_bytes = 0

    def add(self, delta: int) -> None:
        self.live_bytes += delta
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)


class KVCacheStore:
    def __init__(self, ledger: ByteLedger | None = None) -> None:
        self._layers: dict[tuple[int, int], _LayerCache] = {}
        self.ledger = ledger or ByteLedger()

    @property
    def live_bytes(self) -> int:
        return self.ledger.live_bytes

    @property
    def peak_bytes(self) -> int:
        return self.ledger.peak_bytes

    def _track(self, delta: int) -> None:
        self.ledger.add(delta)

    # ---- forward ---------------------------------------------------------------------------
    def append(self, microbatch: int, layer: int, slice_: int, key: torch.Tensor, value: torch.Tensor) -> None:
        cache = self._layers.setdefault((microbatch, layer), _LayerCache())
        if slice_ != len(cache.keys):
            raise RuntimeError(
                f"K/V cache of microbatch {microbatch} layer {layer}: slice {slice_} arrives "
                f"after {len(cache.keys)} cached slices (slices must run forward in order)"
            )
        cache.keys.append(key.detach())
        cache.values.append(value.detach())
        self._track(_nbytes(key) + _nbytes(value))

    def check_recomputed(self, microbatch: int, layer: int, slice_: int) -> None:
        """A recomputed forward of ``slice_`` finds its K/V cached as the newest chunk (backward runs
        slices in reverse, so every later slice was released at this layer)."""
        cache = self._layers.get((microbatch, layer))
        if cache is None or len(cache.keys) != slice_ + 1:
            cached = 0 if cache is None else len(cache.keys)
            raise RuntimeError(
                f"K/V cache of microbatch {microbatch} layer {layer}: slice {slice_} is recomputed with "
                f"{cached} cached slices (expected {slice_ + 1}: recomputation runs in its slice's backward)"
            )

    def prefix(self, microbatch: int, layer: int, slice_: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """K/V chunks of slices ``0 .. slice_-1``."""
        if slice_ == 0:
            return []
        cache = self._layers.get((microbatch, layer))
        if cache is None or len(cache.keys) < slice_ or any(k is None for k in cache.keys[:slice_]):
            raise RuntimeError(f"K/V cache of microbatch {microbatch} layer {layer} lacks the prefix of slice {slice_}")
        return list(zip(cache.keys[:slice_], cache.values[:slice_]))

    # ---- backward --------------------------------------------------------------------------
    def accumulate(self, microbatch: int, layer: int, slice_: int, dk: torch.Tensor, dv: torch.Tensor) -> None:
        """Add a later slice's gradient w.r.t. slice ``slice_``'s K and V."""
        cache = self._layers[(microbatch, layer)]
        if slice_ in cache.grads:
            gk, gv = cache.grads[slice_]
            gk.add_(dk)
            gv.add_(dv)
        else:
            gk, gv = dk.float().clone(), dv.float().clone()
            cache.grads[slice_] = (gk, gv)
            self._track(_nbytes(gk) + _nbytes(gv))

    def take_gradient(self, microbatch: int, layer: int, slice_: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The summed dK/dV later slices sent to ``slice_`` (None if none did), removed from the store."""
        cache = self._layers[(microbatch, layer)]
        grads = cache.grads.pop(slice_, None)
        if grads is not None:
            self._track(-_nbytes(grads[0]) - _nbytes(grads[1]))
        return grads

    def release(self, microbatch: int, layer: int, slice_: int) -> None:
        """Slice ``slice_``'s backward is done at this layer: nothing reads its K/V again."""
        cache = self._layers[(microbatch, layer)]
        if slice_ != len(cache.keys) - 1 or cache.keys[slice_] is None:
            raise RuntimeError(
                f"K/V cache of microbatch {microbatch} layer {layer}: releasing slice {slice_} out of reverse order"
            )
        self._track(-_nbytes(cache.keys[slice_]) - _nbytes(cache.values[slice_]))
        cache.keys.pop()
        cache.values.pop()
        if not cache.keys:
            if cache.grads:
                raise RuntimeError(
                    f"dK/dV of microbatch {microbatch} layer {layer} slices {sorted(cache.grads)} were never consumed"
                )
            del self._layers[(microbatch, layer)]

    def drop_layer(self, microbatch: int, layer: int) -> None:
        """A layer no backward reaches (nothing below it trains): after its last slice, nothing reads
        its K/V again."""
        cache = self._layers.pop((microbatch, layer))
        self._track(-sum(_nbytes(t) for t in cache.keys + cache.values))

    def drop_microbatch(self, microbatch: int) -> None:
        """Forward-only runs: the last slice has been forwarded, nothing will go backward."""
        for key in [k for k in self._layers if k[0] == microbatch]:
            cache = self._layers.pop(key)
            self._track(
                -sum(_nbytes(t) for t in cache.keys + cache.values)
                - sum(_nbytes(g) for pair in cache.grads.values() for g in pair)
            )

    # ---- inspection ------------------------------------------------------------------------
    def storage_ptrs(self) -> set[int]:
        return {
            t.untyped_storage().data_ptr() for c in self._layers.values() for t in c.keys + c.values if t is not None
        }

    def is_empty(self) -> bool:
        return not self._layers

    def describe(self) -> str:
        return ", ".join(
            f"mb{mb} layer{layer}: {len(c.keys)} slice(s), {len(c.grads)} grad(s)"
            for (mb, layer), c in sorted(self._layers.items())
        )
