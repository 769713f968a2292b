"""The recipe's ``dynmo:`` section: per-layer profiling and the dynamic models ``megatron-slim train`` runs.

* ``profile``: time every decoder layer's forward and backward on every rank, smoothed over
  iterations with weight ``profile_smoothing`` for the newest one, and measure its memory; the
  result converts to ``plan.dynmo.costs.LayerCost`` for the repartitioner.
* ``freeze``: a schedule ``"<from_iteration>:<first>-<last>,..."`` (iterations 1-based as the log
  counts them, layers 0-based global indices, ranges inclusive; ``<first>`` alone is one layer).
  From that iteration on those layers are frozen for the rest of training (entries accumulate, so
  ``"3:0-1,6:2-3"`` freezes layers 0-1 from iteration 3 and 0-3 from iteration 6).
* ``exit_threshold`` / ``exit_from_layer``: early exit. A token skips decoder layer ``l >=
  exit_from_layer`` when its confidence on entering the layer is at least ``exit_threshold``
  (0 disables early exit). See ``megatron.model.early_exit`` for the confidence and semantics.
* ``mod_capacity``: mixture of depths; every other layer processes only this share of each
  sequence's tokens, chosen by a router (``plan.dynmo.depth``, ``megatron.model.mixture_of_depths``).
* ``moe_experts`` / ``moe_topk`` / ``moe_drift``: MoE layers and a synthetic router drift
  (``plan.dynmo.moe``, ``megatron.model.moe``).
* ``prune``: gradual magnitude pruning of whole FFN neurons, ``plan.dynmo.prune`` (schedule) and
  ``train.dynmo.prune`` (what runs).
* ``rebalance`` / ``rebalance_interval`` / ``memory_cap_bytes``: the automatic trigger. Every
  ``rebalance_interval`` iterations the smoothed profile is solved (``repartition`` for ``dynmo``,
  ``diffuse`` for ``diffusion``; ``static`` never moves) under the hardware profile's usable memory,
  or ``memory_cap_bytes`` when > 0, and layers move when the predicted gain pays for the move
  (``plan.dynmo.trigger``). Needs ``profile``.
* ``freeze_embedding``: the embedding freezes when layer 0 does. Stages below which nothing trains
  then run no autograd for their input (``megatron.slimpipe.stage``): a stage of frozen layers only
  sends zeros back, which no one below uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_slim.plan.dynmo.prune import PruneSchedule, parse_prune
from megatron_slim.plan.schema import ConfigError, fail

REBALANCE = ("static", "dynmo", "diffusion")
FREEZE_FORMAT = '"<from_iteration>:<first>-<last>,..." (e.g. "5:0-3,10:4-7"), or "" for none'


@dataclass(frozen=True)
class FreezeStep:
    from_iteration: int
    layers: range  # global layer indices frozen from that iteration on


@dataclass(frozen=True)
class DynmoConfig:
    profile: bool = False
    profile_smoothing: float = 0.5  # exponential smoothing: weight of the newest iteration, in (0, 1]
    freeze: str = ""
    exit_threshold: float = 0.0  # 0: no early exit
    exit_from_layer: int = 1
    prune: str = ""  # plan.dynmo.prune.PRUNE_FORMAT
    mod_capacity: float = 0.0  # mixture of depths: share of tokens a routing layer processes; 0: off
    moe_experts: int = 0  # experts per layer; 0: dense MLPs
    moe_topk: int = 2  # experts per token
    moe_drift: float = 0.0  # synthetic router drift (plan.dynmo.moe.drift_bias); 0: none
    rebalance: str = "static"  # static: the split never changes; dynmo / diffusion: the trigger moves layers
    rebalance_interval: int = 10  # iterations between rebalancing decisions
    memory_cap_bytes: float = 0.0  # per-stage cap for the trigger; 0: the hardware profile's usable memory
    freeze_embedding: bool = False  # the embedding freezes with layer 0: a frozen prefix then needs no backward

    def __post_init__(self) -> None:
        if not 0 < self.profile_smoothing <= 1:
            raise fail("dynmo.profile_smoothing", self.profile_smoothing, "a number in (0, 1]")
        if not 0 <= self.exit_threshold <= 1:
            raise fail("dynmo.exit_threshold", self.exit_threshold, "a number in [0, 1] (0 disables early exit)")
        if self.exit_from_layer < 0:
            raise fail("dynmo.exit_from_layer", self.exit_from_layer, "an integer >= 0")
        parse_freeze(self.freeze, None)
        parse_prune(self.prune)
        if not 0 <= self.mod_capacity <= 1:
            raise fail("dynmo.mod_capacity", self.mod_capacity, "a number in [0, 1] (0 disables mixture of depths)")
        self._check_moe()
        if self.rebalance not in REBALANCE:
            raise fail("dynmo.rebalance", self.rebalance, " | ".join(REBALANCE))
        if not isinstance(self.rebalance_interval, int) or self.rebalance_interval < 1:
            raise fail("dynmo.rebalance_interval", self.rebalance_interval, "an integer >= 1")
        if self.memory_cap_bytes < 0:
            raise fail("dynmo.memory_cap_bytes", self.memory_cap_bytes, "a number >= 0 (0: the hardware profile's)")
        if self.rebalancing and not self.profile:
            raise fail(
                "dynmo.rebalance",
                self.rebalance,
                "static unless dynmo.profile=true (the trigger decides from the measured per-layer profile)",
            )

    def _check_moe(self) -> None:
        if self.moe_experts == 1 or self.moe_experts < 0:
            raise fail("dynmo.moe_experts", self.moe_experts, "0 (dense MLPs) or an integer >= 2")
        if self.moe and not 1 <= self.moe_topk <= self.moe_experts:
            raise fail("dynmo.moe_topk", self.moe_topk, f"an integer in [1, dynmo.moe_experts={self.moe_experts}]")
        if self.moe_drift < 0 or (self.moe_drift and not self.moe):
            raise fail("dynmo.moe_drift", self.moe_drift, "a number >= 0, and 0 unless dynmo.moe_experts >= 2")

    @property
    def rebalancing(self) -> bool:
        return self.rebalance != "static"

    @property
    def early_exit(self) -> bool:
        return self.exit_threshold > 0

    @property
    def active(self) -> bool:
        """Whether any dynamic behaviour or the profiler is switched on."""
        dynamic = self.early_exit or bool(self.freeze) or self.prune_schedule is not None or self.mixture_of_depths
        return self.profile or dynamic or self.moe

    @property
    def moe(self) -> bool:
        return self.moe_experts > 0

    @property
    def mixture_of_depths(self) -> bool:
        return self.mod_capacity > 0

    @property
    def prune_schedule(self) -> PruneSchedule | None:
        return parse_prune(self.prune)

    def check_model(self, num_layers: int, recipe: Any = None) -> None:
        """The rules that need the model (layer indices exist) and, given the ``recipe``, what a frozen
        embedding runs with: its own weights (untied), slices without CP or recomputation (the K/V
        cache of a layer no backward reaches is released after its last slice only there)."""
        parse_freeze(self.freeze, num_layers)
        if self.freeze_embedding and recipe is not None:
            self._check_frozen_embedding(recipe.model, recipe.parallel, recipe.train)
        if self.early_exit and not self.exit_from_layer < num_layers:
            raise fail(
                "dynmo.exit_from_layer",
                self.exit_from_layer,
                f"an integer in [0, model.num_layers-1={num_layers - 1}] with dynmo.exit_threshold > 0",
            )

    @staticmethod
    def _check_frozen_embedding(m: Any, p: Any, t: Any) -> None:
        if not m.untie_embeddings_and_output_weights or p.cp > 1 or t.recompute != "none":
            raise fail(
                "dynmo.freeze_embedding",
                True,
                "false unless model.untie_embeddings_and_output_weights=true, parallel.cp=1 and train.recompute=none "
                f"(got {m.untie_embeddings_and_output_weights}, {p.cp}, {t.recompute!r})",
            )

    def freeze_steps(self, num_layers: int) -> tuple[FreezeStep, ...]:
        return parse_freeze(self.freeze, num_layers)


def parse_freeze(text: str, num_layers: int | None) -> tuple[FreezeStep, ...]:
    """The steps of a ``dynmo.freeze`` schedule, in the order written; ``num_layers`` None skips the
    layer-range check (the section is checked before the model is known)."""
    steps = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        step = _parse_step(part, text)
        if num_layers is not None and step.layers.stop > num_layers:
            raise fail("dynmo.freeze", text, f"layers in [0, model.num_layers-1={num_layers - 1}]", f"entry {part!r}")
        steps.append(step)
    return tuple(steps)


def _parse_step(part: str, text: str) -> FreezeStep:
    def bad(problem: str) -> ConfigError:
        return fail("dynmo.freeze", text, FREEZE_FORMAT, f"entry {part!r}: {problem}")

    when, sep, layers = part.partition(":")
    if not sep:
        # YAML reads an unquoted 5:10 as the base-60 integer 310
        raise bad("no ':' between iteration and layers; in --set, quote it: dynmo.freeze='\"5:10\"'")
    first, dash, last = layers.partition("-")
    try:
        iteration, lo = int(when), int(first)
        hi = int(last) if dash else lo
    except ValueError:
        raise bad("not integers") from None
    if iteration < 1:
        raise bad("iterations count from 1")
    if not 0 <= lo <= hi:
        raise bad("layers need 0 <= first <= last")
    return FreezeStep(iteration, range(lo, hi + 1))


def frozen_layers(steps: tuple[FreezeStep, ...], iteration: int) -> frozenset[int]:
    """Global indices of the layers frozen during ``iteration`` (1-based)."""
    return frozenset(layer for s in steps if s.from_iteration <= iteration for layer in s.layers)
