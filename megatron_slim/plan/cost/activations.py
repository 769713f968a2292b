"""Saved activations of one pipeline chunk under recomputation and offloading, per slice.

For a chunk of ``L`` layers and a slice of ``n`` tokens (``A`` = one layer's activations without
recompute, ``K`` = its K/V, ``I`` = a checkpoint's input, ``S`` = a layer's selective savings):

* none:      resident ``L·A``; K/V ``L·K``; nothing rebuilt.
* selective: resident ``L·(A − S)`` (plus ``L·K`` under SlimPipe when ``core_attn`` is checkpointed:
  its K/V inputs duplicate the cache's); K/V ``L·K``; backward rebuilds ``S`` of one layer at a time.
* full:      ``r`` recomputed layers (uniform: all ``L``; block: the first ``N``) keep only their
  checkpoint inputs (uniform: one per group of ``N``; block: one each), the rest keep ``A``:
  resident ``g·I + (L − r)·A``. A recomputed layer's K/V goes too, except under SlimPipe slicing,
  where later slices (and their recomputation) still attend to it from the K/V cache. Backward
  rebuilds one checkpoint at a time: ``b`` layers (uniform: ``N``; block: 1) of ``A`` plus their
  K/V when not cached, less the input already counted: ``b·(A + K) − I``.
* offload ratio ``ρ``: ``ρ`` of the resident layer activations sit in host memory between a
  slice's forward and backward; backward prefetches them back, so they count while it runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_slim.plan.cost.layer import LayerShape, OpWork
from megatron_slim.plan.recompute import Recompute


@dataclass(frozen=True)
class ChunkActivations:
    shape: LayerShape
    plan: Recompute
    layers: int  # decoder layers in one pipeline chunk (stage)
    kv_cached: bool  # SlimPipe slicing: K/V stays in the cache whatever is recomputed

    def layer_bytes(self, tokens: float) -> float:
        """Saved layer activations of the chunk after recomputation, before offloading."""
        s, p, L = self.shape, self.plan, self.layers
        full = s.activation_bytes(tokens)
        if p.granularity == "selective":
            # Under SlimPipe the checkpointed core attention keeps the slice's K and V as its inputs
            # while the K/V cache holds them too (measured on CPU ranks: the stage peak rises).
            duplicate = s.kv_bytes(tokens) if self.kv_cached and "core_attn" in p.modules else 0.0
            return L * (full - s.selective_savings_bytes(tokens, p.modules) + duplicate)
        kept = p.kept_inputs(L) * s.checkpoint_input_bytes(tokens)
        return kept + (L - p.recomputed_layers(L)) * full

    def resident_bytes(self, tokens: float) -> float:
        """What stays on the GPU between a slice's forward and its backward."""
        return self.layer_bytes(tokens) * (1.0 - self.plan.offload_ratio)

    def offloaded_bytes(self, tokens: float) -> float:
        return self.layer_bytes(tokens) * self.plan.offload_ratio

    def kv_layers(self) -> int:
        """Layers whose K/V stays alive from forward to backward."""
        if self.kv_cached:
            return self.layers
        return self.layers - self.plan.recomputed_layers(self.layers)

    def rebuild_bytes(self, tokens: float) -> float:
        """The recompute working set: what one checkpoint's recomputation holds during backward."""
        s, p = self.shape, self.plan
        if p.granularity == "selective":
            return s.selective_savings_bytes(tokens, p.modules)
        b = p.rebuilt_layers(self.layers)
        if b == 0:
            return 0.0
        kv = 0.0 if self.kv_cached else s.kv_bytes(tokens)
        return b * (s.activation_bytes(tokens) + kv) - s.checkpoint_input_bytes(tokens)

    def backward_transient_bytes(self, tokens: float) -> float:
        """Held only while the slice's backward runs: the working set and the prefetched share."""
        return self.rebuild_bytes(tokens) + self.offloaded_bytes(tokens)

    def selective_work(self, tokens: float, prefix: float) -> OpWork:
        """Forward work selective recomputation repeats in the chunk's backward."""
        if self.plan.granularity != "selective":
            return OpWork()
        return self.shape.selective_forward_work(tokens, prefix, self.plan.modules).scale(self.layers)
