"""Before any work: can ``--checkpoint-dir`` be written, and may this recipe resume from it?

A checkpoint resumes under a recipe that differs from the one that wrote it only in
:data:`CHANGEABLE` keys: the run's length and logging, and how the model is split over pipeline
and data-parallel ranks (the state is stored by whole-model parameter name, see
``megatron_slim.train.checkpoint.naming``). Tensor and context parallelism, the model, the data
and the optimizer settings must stay. A changed ``train.iters`` continues with the new recipe's
learning-rate schedule from the saved step count (Megatron's ``--override-opt_param-scheduler``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from megatron_slim.plan.dynmo.options import DynmoConfig
from megatron_slim.plan.files import probe_new_file
from megatron_slim.plan.schema import ConfigError, to_dict
from megatron_slim.train.checkpoint.layout import choose_iteration

CHANGEABLE = (
    "train.iters",
    "train.save_interval",
    "train.log_interval",
    "parallel.pp",
    "parallel.layers_per_stage",
    "parallel.vpp",
    "parallel.dp",
    "schedule.kind",
    "schedule.num_slices",
    "schedule.slice_policy",
    "schedule.vocab_parallel",  # its weight copies and shards are not parameters: the checkpoint is the same
    "train.skip_nonfinite_steps",
    "dynmo.profile",  # measures only
    "dynmo.profile_smoothing",
    "dynmo.freeze",  # which layers train from here on; the saved state is the same either way
    "dynmo.prune",  # pruned neurons are zero in the saved weights and stay pruned under any schedule
    "dynmo.rebalance",  # where layers sit; checkpoints load across splits
    "dynmo.rebalance_interval",
    "dynmo.memory_cap_bytes",
    "dynmo.freeze_embedding",
)
_IGNORED = ("name", "description")


def _flat(recipe: dict) -> dict:
    out = {}
    for key, value in recipe.items():
        if key in _IGNORED:
            continue
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            out[key] = value
    return out


def differing_keys(saved: dict, recipe: dict) -> list[str]:
    """Dotted recipe keys whose values differ and may not change on resume."""
    old, new = _flat(_with_later_sections(saved)), _flat(recipe)
    return sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k) and k not in CHANGEABLE)


def _with_later_sections(saved: dict) -> dict:
    """A checkpoint saved before a recipe section existed was trained with that section's defaults."""
    return {"dynmo": to_dict(DynmoConfig()), **saved}


def check_checkpoint_dir(directory: str) -> None:
    """``--checkpoint-dir`` is (or can become) a writable directory."""

    def fail(reason: str) -> ConfigError:
        return ConfigError(
            f"--checkpoint-dir {directory}: {reason}; allowed: a writable directory (created if missing)"
        )

    path = Path(directory)
    if directory == "":
        raise fail("empty path")
    if path.exists() and not path.is_dir():
        raise fail("it is a file, not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe_new_file(path, prefix=".write-probe.")
    except OSError as exc:
        raise fail(f"cannot write there ({exc.strerror or exc})") from None


def check_resumable(directory: str, recipe: dict, say: Callable[[str], None] = print) -> Optional[int]:
    """The iteration a run of ``recipe`` resumes from in ``directory`` (None: nothing saved).

    Passes over a ``latest`` iteration that is missing or fails its checksums to the newest intact
    one, saying so in one line; raises ``ConfigError`` when none is intact, when the checkpoint came
    from an incompatible recipe, or when it lies past ``train.iters``."""
    choice = choose_iteration(directory)
    if choice.iteration is None:
        if choice.skipped:
            raise ConfigError(
                f"--checkpoint-dir {directory}: no intact checkpoint to resume from ("
                f"{'; '.join(choice.skipped)}); allowed: a directory with an intact iteration, "
                "another directory, or --no-resume to start from scratch"
            )
        return None
    if choice.skipped:
        say(
            f"checkpoint: skipped {'; '.join(choice.skipped)}; resuming from iteration {choice.iteration}, "
            "the newest intact one"
        )
    assert choice.recipe is not None, "an intact iteration carries its recipe"
    diff = differing_keys(choice.recipe, recipe)
    if diff:
        raise ConfigError(
            f"--checkpoint-dir {directory}: its checkpoint (iteration {choice.iteration}) was written "
            f"by a different recipe (differs in: {', '.join(diff)}); only {', '.join(CHANGEABLE)} may "
            "change on resume: use the same recipe otherwise, another directory, or --no-resume"
        )
    iters = recipe["train"]["iters"]
    if iters < choice.iteration:
        raise ConfigError(
            f"train.iters: got {iters}, but --checkpoint-dir {directory} holds iteration "
            f"{choice.iteration}; allowed: train.iters >= {choice.iteration}, another directory, "
            "or --no-resume"
        )
    return choice.iteration
