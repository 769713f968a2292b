"""Per-iteration metrics of ``megatron-slim train`` under Megatron-LM's names, to TensorBoard and W&B.

The reporting rank (last pipeline stage, first tp/cp/dp rank) writes, every iteration, the tags
Megatron-LM's ``training_log`` writes (megatron/training/training.py): ``lm loss``,
``learning-rate``, ``grad-norm``, ``batch-size`` (each also ``<tag> vs samples``, with the consumed
samples as the step), ``iteration-time`` (seconds) and ``throughput`` (TFLOP/s per rank: the model
FLOPs of megatron-slim's cost model, the simulator's MFU numerator). Megatron-LM has no tag for
these; megatron-slim adds them: ``tokens-per-second``, and, since CPU ranks have no CUDA allocator
statistics (Megatron's ``mem-max-allocated-bytes``), ``mem-peak-activation-bytes`` and
``mem-peak-kv-bytes``: the reporting rank's measured peak of the tensors autograd saves and of the
K/V cache so far (the JSON's per-stage figures). W&B gets the same values (no ``vs samples``
copies; ``samples vs steps`` as Megatron logs it).

``tensorboard`` (the ``metrics`` extra) and ``wandb`` are optional: asking for either without it
installed is a named error before any work.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Optional

from megatron_slim.plan.schema import ConfigError

VS_SAMPLES = ("lm loss", "learning-rate", "grad-norm", "batch-size")  # Megatron's "<tag> vs samples" copies


@dataclass(frozen=True)
class MetricsOptions:
    tensorboard_dir: Optional[str] = None
    wandb_project: Optional[str] = None
    wandb_exp_name: Optional[str] = None
    wandb_save_dir: Optional[str] = None

    @property
    def enabled(self) -> bool:
        return bool(self.tensorboard_dir or self.wandb_project)


def metrics_options(args) -> MetricsOptions:
    """The train command's flags, checked before any work: a W&B detail without ``--wandb-project``
    is refused, and each backend asked for must be importable."""
    options = MetricsOptions(args.tensorboard_dir, args.wandb_project, args.wandb_exp_name, args.wandb_save_dir)
    for flag, value in (("--wandb-exp-name", options.wandb_exp_name), ("--wandb-save-dir", options.wandb_save_dir)):
        if value is not None and not options.wandb_project:
            raise ConfigError(
                f"{flag} {value}: takes effect only with --wandb-project NAME; allowed: add --wandb-project, or drop it"
            )
    if options.wandb_project is not None and not options.wandb_project.strip():
        raise ConfigError("--wandb-project '': empty project name; allowed: a W&B project name")
    if options.tensorboard_dir is not None:
        _require("torch.utils.tensorboard", "--tensorboard-dir", "tensorboard", "'megatron-slim[metrics]'")
    if options.wandb_project:
        _require("wandb", "--wandb-project", "wandb", "wandb")
    return options


def _require(module: str, flag: str, package: str, pip_spec: str) -> None:
    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(
            f"{flag}: needs the {package} package, which is not installed ({exc}); allowed: "
            f"install it (pip install {pip_spec}), or drop {flag}"
        ) from None


def iteration_scalars(
    recipe,
    flops_per_iteration: float,
    loss: float,
    learning_rate: float,
    grad_norm: float,
    seconds: float,
    peak_activation_bytes: int,
    peak_kv_bytes: int,
) -> dict[str, float]:
    """One iteration's values under their tags (see the module docstring)."""
    tokens = recipe.train.global_batch_size * recipe.model.seq_length
    per_second = 1.0 / seconds if seconds > 0 else 0.0
    return {
        "lm loss": loss,
        "learning-rate": learning_rate,
        "grad-norm": grad_norm,
        "batch-size": float(recipe.train.global_batch_size),
        "iteration-time": seconds,
        "throughput": flops_per_iteration * per_second / 1e12 / recipe.parallel.world_size,
        "tokens-per-second": tokens * per_second,
        "mem-peak-activation-bytes": float(peak_activation_bytes),
        "mem-peak-kv-bytes": float(peak_kv_bytes),
    }


def model_flops_per_iteration(recipe) -> float:
    """Model FLOPs (forward + backward) of one iteration over all ranks, as the cost model counts them."""
    from megatron_slim.plan.cost.model import CostModel
    from megatron_slim.plan.sim.costs import RecipeCosts

    p = recipe.parallel
    # RecipeCosts counts one data-parallel replica's microbatches per tp*cp GPU share
    return RecipeCosts(recipe, CostModel(recipe)).model_flops() * p.tp * p.cp * p.dp


class MetricsWriter:
    """Opened on the reporting rank only. Every ``log`` is flushed, so a run that dies keeps what
    it logged."""

    def __init__(self, options: MetricsOptions, recipe) -> None:
        self.recipe = recipe
        self.flops = model_flops_per_iteration(recipe)
        self.tensorboard = self.wandb = None
        if options.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(log_dir=options.tensorboard_dir)
        if options.wandb_project:
            import wandb

            kwargs = {"project": options.wandb_project, "name": options.wandb_exp_name, "config": recipe.to_dict()}
            if options.wandb_save_dir:
                kwargs["dir"] = options.wandb_save_dir
            wandb.init(**kwargs)
            self.wandb = wandb

    def log(self, iteration: int, loss: float, learning_rate: float, grad_norm: float, seconds: float, report) -> None:
        scalars = iteration_scalars(
            self.recipe,
            self.flops,
            loss,
            learning_rate,
            float(grad_norm),
            seconds,
            report.peak_activation_bytes,
            report.peak_kv_bytes,
        )
        samples = iteration * self.recipe.train.global_batch_size
        if self.tensorboard is not None:
            for tag, value in scalars.items():
                self.tensorboard.add_scalar(tag, value, iteration)
                if tag in VS_SAMPLES:
                    self.tensorboard.add_scalar(f"{tag} vs samples", value, samples)
            self.tensorboard.flush()
        if self.wandb is not None:
            self.wandb.log({**scalars, "samples vs steps": samples}, step=iteration)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


def open_metrics(options: Optional[MetricsOptions], recipe, reporter: bool) -> Optional[MetricsWriter]:
    return MetricsWriter(options, recipe) if reporter and options is not None and options.enabled else None
