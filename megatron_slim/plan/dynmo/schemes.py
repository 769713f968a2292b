"""How each dynamic training technique changes every decoder layer's load as training goes on.

A scheme maps training progress ``x`` in [0, 1] (the middle of a phase) to one ``LayerLoad`` per
layer: multipliers of the layer's static forward time, backward time and saved activations. They
are models of the techniques DynMo evaluates (arXiv 2505.14864, §2 and §5), stated here so a
reader can check them; the figures they produce are simulated, not measured:

* ``freeze``: Egeria/AutoFreeze-style freezing from the front, linearly up to half the layers at
  the end of training. A frozen prefix needs no backward at all (nothing before it wants
  gradients) and saves no activations.
* ``early-exit``: tokens leave after a confident layer; the share still running at layer ``l`` of
  ``L`` falls linearly to ``1 - 0.8 x`` at the last layer (exits grow as the model learns).
* ``prune``: global gradual magnitude pruning (Zhu & Gupta's cubic schedule to 90% sparsity);
  global thresholds prune deeper layers harder (density weight rising linearly with depth, mean
  1); sparse kernels cut the GEMM share of the layer's time by its density, attention stays dense.
* ``mod``: Mixture-of-Depths: every other layer routes 12.5% of the tokens, the rest skip it;
  fixed from the start, so the imbalance is only the odd/even count per stage.
* ``moe``: router drift: the most loaded expert's share of a layer's MLP work drifts between 1x
  and 2x the mean, a seeded random walk per layer (tokens are not dropped: Megatron's default has
  no capacity factor), so the MLP share of a layer's time scales by that factor.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from megatron_slim.plan.schema import ConfigError


@dataclass(frozen=True)
class LayerLoad:
    forward: float = 1.0
    backward: float = 1.0
    activations: float = 1.0


SCHEMES = ("freeze", "early-exit", "prune", "mod", "moe")


def layer_loads(scheme: str, x: float, num_layers: int, gemm_share: float, seed: int = 0) -> list[LayerLoad]:
    """Per-layer multipliers of ``scheme`` at progress ``x``; ``gemm_share``: the share of a layer's
    time in GEMMs (pruning and MoE drift scale that part only)."""
    if scheme not in SCHEMES:
        raise ConfigError(f"--dynamic: got {scheme!r}; allowed: {', '.join(SCHEMES)}")
    if not 0.0 <= x <= 1.0:
        raise ConfigError(f"training progress: got {x}; allowed: a fraction in [0, 1]")
    make: dict[str, Callable[[], list[LayerLoad]]] = {
        "freeze": lambda: _freeze(x, num_layers),
        "early-exit": lambda: _early_exit(x, num_layers),
        "prune": lambda: _prune(x, num_layers, gemm_share),
        "mod": lambda: _mixture_of_depths(num_layers),
        "moe": lambda: _router_drift(x, num_layers, gemm_share, seed),
    }
    return make[scheme]()


def _freeze(x: float, num_layers: int) -> list[LayerLoad]:
    frozen = int(x * num_layers / 2)
    return [LayerLoad(1.0, 0.0, 0.0) if layer < frozen else LayerLoad() for layer in range(num_layers)]


def _early_exit(x: float, num_layers: int) -> list[LayerLoad]:
    exited_by_last = 0.8 * x
    out = []
    for layer in range(num_layers):
        running = 1.0 - exited_by_last * layer / max(num_layers - 1, 1)
        out.append(LayerLoad(running, running, running))
    return out


def _prune(x: float, num_layers: int, gemm_share: float) -> list[LayerLoad]:
    sparsity = 0.9 * (1.0 - (1.0 - x) ** 3)
    out = []
    for layer in range(num_layers):
        depth_weight = 0.5 + layer / max(num_layers - 1, 1)  # 0.5 .. 1.5, mean 1
        density = max(0.02, 1.0 - sparsity * depth_weight)
        time = 1.0 - gemm_share + gemm_share * density
        out.append(LayerLoad(time, time, 1.0))
    return out


def _mixture_of_depths(num_layers: int) -> list[LayerLoad]:
    routed = 0.125
    return [LayerLoad(routed, routed, routed) if layer % 2 else LayerLoad() for layer in range(num_layers)]


def _router_drift(x: float, num_layers: int, gemm_share: float, seed: int) -> list[LayerLoad]:
    out = []
    for layer in range(num_layers):
        rng = random.Random(seed * 100_003 + layer)
        phase, speed = rng.uniform(0, 2 * math.pi), rng.uniform(1.0, 4.0)
        hottest = 1.5 + 0.5 * math.sin(phase + speed * 2 * math.pi * x)  # 1x .. 2x the mean expert load
        mlp_share = gemm_share * 2 / 3  # two thirds of a Llama layer's GEMM FLOPs are its MLP
        time = 1.0 - mlp_share + mlp_share * hottest
        out.append(LayerLoad(time, time, 1.0))
    return out
