"""The ``--dynmo-*`` flags of ``python -m megatron_slim.launch``, and the recipe's ``dynmo:`` section
they stand for.

The launcher runs per-layer profiling (``--dynmo-profile``) and layer freezing (``--dynmo-freeze``)
inside Megatron-LM's own loop (``megatron.dynmo``). Early exit swaps the decoder layer class and
rebalancing moves layers between ranks, neither of which Megatron-LM's model builder or optimizer
can follow, so both run in ``megatron-slim train`` only and are refused here at start-up.
Imports no megatron and no torch.
"""

from __future__ import annotations

import argparse
from dataclasses import fields

from megatron_slim.plan.dynmo.options import FREEZE_FORMAT, DynmoConfig
from megatron_slim.plan.schema import ConfigError

# recipe key -> launcher flag, for the keys the launcher runs
LAUNCHER_FLAGS = {
    "profile": "--dynmo-profile",
    "profile_smoothing": "--dynmo-profile-smoothing",
    "freeze": "--dynmo-freeze",
}
# registered so that a user who passes them hears why they do not run here
TRAIN_ONLY_FLAGS = {"exit_threshold": "--dynmo-exit-threshold", "exit_from_layer": "--dynmo-exit-from-layer"}
_DEFAULTS = DynmoConfig()
WHERE = "runs in `megatron-slim train` only (not through Megatron-LM's loop)"


def add_dynmo_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("megatron-slim dynmo (per-layer profiling and layer freezing)")
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
        help=f"freeze decoder layers from an iteration on: {FREEZE_FORMAT}; their weights and optimizer "
        "state stay bit-identical from then on (dynmo.freeze)",
    )
    g.add_argument(
        "--dynmo-exit-threshold",
        type=float,
        metavar="X",
        default=_DEFAULTS.exit_threshold,
        help=f"early exit {WHERE}; this launcher accepts only 0",
    )
    g.add_argument(
        "--dynmo-exit-from-layer",
        type=int,
        metavar="N",
        default=_DEFAULTS.exit_from_layer,
        help=f"early exit {WHERE}; this launcher accepts only the default 1",
    )


def dynmo_from_megatron_args(args: argparse.Namespace) -> DynmoConfig:
    """The ``dynmo:`` section the parsed ``--dynmo-*`` flags stand for; errors name the flag."""
    flags = LAUNCHER_FLAGS | TRAIN_ONLY_FLAGS
    # a namespace parsed without our flags (a script's own parser) keeps the section's defaults
    values = {key: getattr(args, flag[2:].replace("-", "_"), getattr(_DEFAULTS, key)) for key, flag in flags.items()}
    try:
        return DynmoConfig(**values)
    except ConfigError as exc:
        raise ConfigError(_with_flag_names(str(exc))) from None


def check_dynmo_args(args: argparse.Namespace) -> DynmoConfig:
    """Start-up checks of the ``--dynmo-*`` flags against the model and the launcher's abilities."""
    d = dynmo_from_megatron_args(args)
    _refuse_train_only(d, TRAIN_ONLY_FLAGS)
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
    return d


def dynmo_to_megatron_args(d: DynmoConfig) -> list[str]:
    """The launcher flags a recipe's ``dynmo:`` section stands for (``megatron-args``); a key the
    launcher cannot run, set away from its default, is refused naming it."""
    _refuse_train_only(d, {f.name: f"dynmo.{f.name}" for f in fields(d) if f.name not in LAUNCHER_FLAGS})
    out: list[str] = []
    if d.profile:
        out += [LAUNCHER_FLAGS["profile"]]
        if d.profile_smoothing != _DEFAULTS.profile_smoothing:
            out += [LAUNCHER_FLAGS["profile_smoothing"], repr(d.profile_smoothing)]
    if d.freeze:
        out += [LAUNCHER_FLAGS["freeze"], d.freeze]
    return out


def _refuse_train_only(d: DynmoConfig, names: dict[str, str]) -> None:
    for key, name in names.items():
        value, default = getattr(d, key), getattr(_DEFAULTS, key)
        if value != default:
            what = "early exit" if key.startswith("exit") else key.replace("_", " ")
            raise ConfigError(
                f"{name}: got {value!r}; {what} {WHERE}: Megatron-LM's model builder and optimizer cannot "
                f"follow it; allowed here: {default!r} (run it with megatron-slim train --recipe R --set "
                f"dynmo.{key}=...)"
            )


def _with_flag_names(message: str) -> str:
    for key, flag in sorted((LAUNCHER_FLAGS | TRAIN_ONLY_FLAGS).items(), key=lambda kv: -len(kv[0])):
        message = message.replace(f"dynmo.{key}", flag)
    return message.replace("model.num_layers", "--num-layers")
