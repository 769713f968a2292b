"""The ``--dynmo-*`` flags of ``python -m megatron_slim.launch``, and the recipe's ``dynmo:`` section
they stand for.

The launcher runs per-layer profiling (``--dynmo-profile``), layer freezing (``--dynmo-freeze``),
early exit (``--dynmo-exit-threshold``, ``--dynmo-exit-from-layer``), mixture of depths
(``--dynmo-mod-capacity``) and gradual pruning (``--dynmo-prune``) inside Megatron-LM's own loop
(``megatron.dynmo``). The other keys of the section need what only ``megatron-slim train`` has
(``TRAIN_ONLY``) and are refused at start-up.
Imports no megatron and no torch.
"""

from __future__ import annotations

import argparse
from dataclasses import fields

from megatron_slim.plan.dynmo.options import FREEZE_FORMAT, DynmoConfig
from megatron_slim.plan.dynmo.prune import PRUNE_FORMAT
from megatron_slim.plan.schema import ConfigError

# recipe key -> launcher flag, for the keys the launcher runs
LAUNCHER_FLAGS = {
    "profile": "--dynmo-profile",
    "profile_smoothing": "--dynmo-profile-smoothing",
    "freeze": "--dynmo-freeze",
    "exit_threshold": "--dynmo-exit-threshold",
    "exit_from_layer": "--dynmo-exit-from-layer",
    "mod_capacity": "--dynmo-mod-capacity",
    "prune": "--dynmo-prune",
}
_MOE = "dynmo's MoE layers with router drift (Megatron-LM's own MoE is --num-experts)"
_MOVES = "moving layers between ranks, which Megatron-LM's model builder and optimizer cannot follow"
# recipe key -> why it runs in `megatron-slim train` only
TRAIN_ONLY = {
    "moe_experts": _MOE,
    "moe_topk": _MOE,
    "moe_drift": _MOE,
    "rebalance": _MOVES,
    "rebalance_interval": _MOVES,
    "memory_cap_bytes": _MOVES,
    "freeze_embedding": "a frozen embedding lets stages skip autograd for their input, which needs megatron-slim's "
    "pipeline stages",
}
_DEFAULTS = DynmoConfig()


def add_dynmo_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("megatron-slim dynmo (profiling, freezing, early exit, mixture of depths, pruning)")
    g.add_argument(
        "--dynmo-profile",
        action="store_true",
        help="time every decoder layer's forward and backward on every rank and measure its memory; logged "
        "every --log-interval and written per rank under --dynmo-profile-dir (dynmo.profile)",
    )
    g.add_argument(
        "--dynmo-profile-smoothing",
        type=float,
        metavar="W",
        default=_DEFAULTS.profile_smoothing,
        help="weight of the newest iteration in the profile's exponential smoothing, in (0, 1] (default 0.5)",
    )
    g.add_argument(
        "--dynmo-profile-dir",
        default=None,
        metavar="DIR",
        help="with --dynmo-profile: write DIR/layer_profile.rank<R>.json every --log-interval (default: log only)",
    )
    g.add_argument(
        "--dynmo-freeze",
        default="",
        metavar="SPEC",
        help=f"freeze decoder layers from an iteration on: {FREEZE_FORMAT}; they skip their weight gradients "
        "(they compute and drop them with --overlap-grad-reduce) and their weights and optimizer state stay "
        "bit-identical from then on (dynmo.freeze)",
    )
    _add_dynamic_model_arguments(g)


def _add_dynamic_model_arguments(g) -> None:
    g.add_argument(
        "--dynmo-exit-threshold",
        type=float,
        metavar="X",
        default=_DEFAULTS.exit_threshold,
        help="early exit: a token skips the MLP of layers >= --dynmo-exit-from-layer once its confidence "
        "reaches X, in [0, 1] (default 0: off; dynmo.exit_threshold); tokens per layer are logged",
    )
    g.add_argument(
        "--dynmo-exit-from-layer",
        type=int,
        metavar="N",
        default=_DEFAULTS.exit_from_layer,
        help="early exit: the first (0-based) layer a token may skip (default 1; dynmo.exit_from_layer)",
    )
    g.add_argument(
        "--dynmo-mod-capacity",
        type=float,
        metavar="C",
        default=_DEFAULTS.mod_capacity,
        help="mixture of depths: every other layer runs only this share of each sequence's tokens, picked by "
        "a router, in [0, 1] (default 0: off; dynmo.mod_capacity); tokens per layer are logged",
    )

    g.add_argument(
        "--dynmo-prune",
        default="",
        metavar="SPEC",
        help=f"gradual magnitude pruning of whole FFN neurons (bias-free SwiGLU MLPs): {PRUNE_FORMAT}; pruned "
        "weights and their Adam moments stay zero and the MLP computes the kept neurons only; kept neurons per "
        "layer are logged (dynmo.prune)",
    )


def dynmo_from_megatron_args(args: argparse.Namespace) -> DynmoConfig:
    """The ``dynmo:`` section the parsed ``--dynmo-*`` flags stand for; errors name the flag."""
    # a namespace parsed without our flags (a script's own parser) keeps the section's defaults
    values = {
        key: getattr(args, flag[2:].replace("-", "_"), getattr(_DEFAULTS, key)) for key, flag in LAUNCHER_FLAGS.items()
    }
    try:
        return DynmoConfig(**values)
    except ConfigError as exc:
        raise ConfigError(_with_flag_names(str(exc))) from None


def check_dynmo_args(args: argparse.Namespace) -> DynmoConfig:
    """Start-up checks of the ``--dynmo-*`` flags against the model and the launcher's abilities."""
    d = dynmo_from_megatron_args(args)
    if getattr(args, "dynmo_profile_dir", None) and not d.profile:
        raise ConfigError("--dynmo-profile-dir: given without --dynmo-profile; allowed: both or neither")
    if not d.active:
        return d
    try:
        d.check_model(args.num_layers)
    except ConfigError as exc:
        raise ConfigError(_with_flag_names(str(exc))) from None
    if d.profile and getattr(args, "recompute_granularity", None):
        raise ConfigError(
            f"--dynmo-profile: got it with --recompute-granularity {args.recompute_granularity}; a recomputed "
            "forward would count as backward; allowed: --dynmo-profile without activation recomputation"
        )
    _check_dynamic_layers(args, d)
    return d


def _check_dynamic_layers(args: argparse.Namespace, d: DynmoConfig) -> None:
    experts = getattr(args, "num_experts", None) or 0
    tp, cp = (getattr(args, name, 1) or 1 for name in ("tensor_model_parallel_size", "context_parallel_size"))
    slices = getattr(args, "slimpipe_num_slices", 1) or 1
    packing = getattr(args, "slimpipe_packing", "none") or "none"
    shared = {"--sequence-parallel": bool(getattr(args, "sequence_parallel", False))}
    shared[f"--num-experts {experts}"] = experts > 0
    if d.early_exit:
        conflicts = {**shared, "--cp-remap": bool(getattr(args, "cp_remap", False))}
        conflicts[f"--dynmo-mod-capacity {d.mod_capacity}"] = d.mixture_of_depths
        why = "exits are chosen per token of a whole sequence"
        _refuse_beside("--dynmo-exit-threshold", d.exit_threshold, conflicts, why)
    if d.mixture_of_depths:
        conflicts = {**shared, f"--tensor-model-parallel-size {tp}": tp > 1, f"--context-parallel-size {cp}": cp > 1}
        conflicts |= {f"--slimpipe-num-slices {slices}": slices > 1, f"--slimpipe-packing {packing}": packing != "none"}
        why = "a router picks tokens of one whole, unpacked sequence on one rank"
        _refuse_beside("--dynmo-mod-capacity", d.mod_capacity, conflicts, why)
    if d.prune_schedule is not None:
        conflicts = {**shared, f"--tensor-model-parallel-size {tp}": tp > 1}
        conflicts["an MLP other than bias-free SwiGLU (--swiglu --disable-bias-linear)"] = not (
            getattr(args, "swiglu", True) and not getattr(args, "add_bias_linear", False)
        )
        on = [name for name, is_on in conflicts.items() if is_on]
        if on:
            raise ConfigError(
                f'--dynmo-prune: got {d.prune!r} with {on[0]}; allowed: "" (off) beside it (neurons are chosen '
                "per whole, bias-free SwiGLU MLP on one rank, in dense layers)"
            )


def _refuse_beside(flag: str, value: float, conflicts: dict[str, bool], why: str) -> None:
    on = [name for name, is_on in conflicts.items() if is_on]
    if on:
        raise ConfigError(f"{flag}: got {value} with {on[0]}; allowed: 0 (off) beside it ({why}, in dense layers)")


def dynmo_to_megatron_args(d: DynmoConfig) -> list[str]:
    """The launcher flags a recipe's ``dynmo:`` section stands for (``megatron-args``); a key the
    launcher cannot run, set away from its default, is refused naming it."""
    for f in fields(d):
        value, default = getattr(d, f.name), getattr(_DEFAULTS, f.name)
        if f.name in TRAIN_ONLY and value != default:
            raise ConfigError(
                f"dynmo.{f.name}: got {value!r}; runs in `megatron-slim train` only ({TRAIN_ONLY[f.name]}); "
                f"allowed here: {default!r} (run it with megatron-slim train --recipe R --set dynmo.{f.name}=...)"
            )
    out: list[str] = []
    for key, flag in LAUNCHER_FLAGS.items():
        value = getattr(d, key)
        if value == getattr(_DEFAULTS, key) or (key == "profile_smoothing" and not d.profile):
            continue
        out += [flag] if isinstance(value, bool) else [flag, value if isinstance(value, str) else repr(value)]
    return out


def _with_flag_names(message: str) -> str:
    for key, flag in sorted(LAUNCHER_FLAGS.items(), key=lambda kv: -len(kv[0])):
        message = message.replace(f"dynmo.{key}", flag)
    return message.replace("model.num_layers", "--num-layers")
