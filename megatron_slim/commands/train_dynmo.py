"""``megatron-slim train --dynmo-*``: flags for the recipe's ``dynmo:`` section, and its JSON entry.

Each flag is the ``--set dynmo.<key>=<value>`` it names, applied after ``--set`` (see
``docs/dynmo.md``). No torch here: ``cli`` imports it to build the parser.
"""

from __future__ import annotations

import argparse

from megatron_slim.plan.dynmo.options import FREEZE_FORMAT, REBALANCE
from megatron_slim.plan.dynmo.prune import PRUNE_FORMAT

# flag attribute -> recipe key
_KEYS = {
    "dynmo_profile": "profile",
    "dynmo_profile_smoothing": "profile_smoothing",
    "dynmo_freeze": "freeze",
    "dynmo_freeze_embedding": "freeze_embedding",
    "dynmo_exit_threshold": "exit_threshold",
    "dynmo_exit_from_layer": "exit_from_layer",
    "dynmo_prune": "prune",
    "dynmo_mod_capacity": "mod_capacity",
    "dynmo_moe_experts": "moe_experts",
    "dynmo_moe_topk": "moe_topk",
    "dynmo_moe_drift": "moe_drift",
    "dynmo_rebalance": "rebalance",
    "dynmo_rebalance_interval": "rebalance_interval",
    "dynmo_memory_cap_bytes": "memory_cap_bytes",
}
_QUOTED = ("freeze", "prune")  # YAML would read "5:10" as a base-60 integer


def add_dynmo_args(train: argparse.ArgumentParser) -> None:
    group = train.add_argument_group("dynamic models and per-layer profiling (the recipe's dynmo: section)")
    group.add_argument(
        "--dynmo-profile",
        action="store_true",
        default=None,
        help="time every decoder layer's forward and backward on every rank and measure its memory "
        "(parameters, gradients, optimizer state, activations per microbatch); the smoothed whole-model "
        "profile is in --json under dynmo.layer_profile (dynmo.profile)",
    )
    group.add_argument(
        "--dynmo-profile-smoothing",
        metavar="W",
        help="weight of the newest iteration in the exponential smoothing, in (0, 1] (default 0.5)",
    )
    group.add_argument(
        "--dynmo-freeze",
        metavar="SPEC",
        help=f"freeze decoder layers from an iteration on: {FREEZE_FORMAT}; frozen layers skip weight "
        "gradients and optimizer steps (dynmo.freeze)",
    )
    group.add_argument(
        "--dynmo-freeze-embedding",
        action="store_true",
        default=None,
        help="freeze the embedding with layer 0: stages below which nothing trains then run no backward "
        "(untied embeddings, parallel.cp=1, train.recompute=none; dynmo.freeze_embedding)",
    )
    group.add_argument(
        "--dynmo-exit-threshold",
        metavar="X",
        help="early exit: a token skips a layer once its confidence is at least X, in [0, 1] "
        "(0: off, the default; dynmo.exit_threshold)",
    )
    group.add_argument(
        "--dynmo-exit-from-layer",
        metavar="N",
        help="the first layer (0-based) a token may skip (default 1; dynmo.exit_from_layer)",
    )
    _add_model_args(group)
    _add_rebalance_args(group)


def _add_model_args(group) -> None:
    """The dynamic models beyond freezing and early exit."""
    group.add_argument(
        "--dynmo-prune",
        metavar="SPEC",
        help=f"gradual magnitude pruning of whole FFN neurons, cubic ramp (Zhu & Gupta 2017): {PRUNE_FORMAT}; "
        "pruned neurons stay zero and are left out of the MLP's matmuls (dynmo.prune)",
    )
    group.add_argument(
        "--dynmo-mod-capacity",
        metavar="C",
        help="mixture of depths: every other layer runs only the share C in [0, 1] of each sequence's tokens "
        "its router scores highest, the rest skip it (0: off, the default; training only: the choice "
        "sees the whole sequence; dynmo.mod_capacity)",
    )
    group.add_argument(
        "--dynmo-moe-experts",
        metavar="E",
        help="MoE: every layer's MLP becomes E >= 2 local experts (0: dense, the default); --json reports "
        "the tokens per expert of each layer in every iteration under dynmo.expert_load (dynmo.moe_experts)",
    )
    group.add_argument("--dynmo-moe-topk", metavar="K", help="MoE: experts per token (default 2; dynmo.moe_topk)")
    group.add_argument(
        "--dynmo-moe-drift",
        metavar="D",
        help="MoE: synthetic load drift, a router logit bias growing by D per iteration toward the "
        "higher-numbered experts (default 0; dynmo.moe_drift)",
    )


def _add_rebalance_args(group) -> None:
    group.add_argument(
        "--dynmo-rebalance",
        choices=REBALANCE,
        help="move layers between pipeline stages from the measured profile: static (never, the default), "
        "dynmo (exact min-max split) or diffusion (neighbour greedy); needs --dynmo-profile, pp >= 2, vpp = 1; "
        "decisions are logged and in --json under dynmo.rebalance (dynmo.rebalance)",
    )
    group.add_argument(
        "--dynmo-rebalance-interval",
        metavar="N",
        help="iterations between rebalancing decisions, >= 1 (default 10; dynmo.rebalance_interval)",
    )
    group.add_argument(
        "--dynmo-memory-cap-bytes",
        metavar="B",
        help="per-stage memory cap the rebalancer keeps every stage under (default 0: the hardware "
        "profile's usable memory; dynmo.memory_cap_bytes)",
    )


def dynmo_overrides(args: argparse.Namespace) -> list[str]:
    """The ``--set`` entries the given ``--dynmo-*`` flags stand for."""
    out = []
    for attr, key in _KEYS.items():
        value = getattr(args, attr, None)
        if value is None:
            continue
        if key in _QUOTED:
            value = '"' + str(value).replace('"', "") + '"'
        out.append(f"dynmo.{key}={str(value).lower() if isinstance(value, bool) else value}")
    return out


def dynmo_entry(reports, pp: int) -> dict:
    """The JSON ``dynmo`` section: the smoothed whole-model profile and frozen layers of the last
    iteration, the rebalancing decisions (``rebalance``, every rank takes the same), and per layer
    the share of tokens that ran it and of FFN neurons kept (from each stage's first rank)."""
    stages = sorted(
        (r for r in reports if r.dp_rank == 0 and r.tp_rank == 0 and r.cp_rank == 0), key=lambda r: r.pp_rank
    )
    last = stages[-1].dynmo if stages else {}
    entry = {key: last[key] for key in ("layer_profile", "frozen_layers", "rebalance") if key in last}
    for key in ("active_token_share", "kept_neuron_share", "expert_load"):
        per_layer = {layer: share for r in stages for layer, share in r.dynmo.get(key, {}).items()}
        if per_layer:
            entry[key] = {str(layer): per_layer[layer] for layer in sorted(per_layer)}
    return entry
