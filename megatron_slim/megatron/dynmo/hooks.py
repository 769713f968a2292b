"""``--dynmo-*`` around Megatron-LM's ``train_step``: profiling, freezing, pruning and the token
counts of early exit and mixture of depths (whose layer classes enter through the layer spec:
``layers``).

``train_step(forward_step_func, data_iterator, model, optimizer, ...)`` is the one call per
iteration that sees the built model chunks and optimizer, on every Megatron-LM release; the wrapper
sets up the profiler, the freezer, the pruner and the token counter on its first call, applies the
freeze and prune schedules for the iteration before it (iterations 1-based, as Megatron logs them:
``args.curr_iteration + 1``), and closes the iteration's profile and token
counts after it.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Optional

import torch.distributed as dist

from megatron_slim.plan.dynmo.options import frozen_layers


class LaunchDynmo:
    """The dynmo pieces of one ``pretrain()`` run, built from its parsed args, model and optimizer."""

    def __init__(self, args, model, optimizer) -> None:
        from megatron_slim.megatron.dynmo.main_params import MainParams
        from megatron_slim.megatron.launch.dynmo_flags import dynmo_from_megatron_args

        config = dynmo_from_megatron_args(args)
        self.args = args
        self.optimizer = optimizer
        main_params = MainParams(optimizer)
        self.freeze_steps = config.freeze_steps(args.num_layers)
        self.freezer = _freezer(args, model, optimizer, main_params) if self.freeze_steps else None
        self.token_counts = None
        if config.early_exit or config.mixture_of_depths:
            from megatron_slim.megatron.dynmo.token_counts import TokenCounts

            self.token_counts = TokenCounts(model)
        self.pruning = None
        if config.prune_schedule is not None:
            from megatron_slim.megatron.dynmo.profile_log import unwrapped
            from megatron_slim.megatron.dynmo.prune import LaunchPruning

            self.pruning = LaunchPruning(config.prune_schedule, [unwrapped(c) for c in model], main_params)
        self.profile_log = None
        if config.profile:
            from megatron_slim.megatron.dynmo.profile_log import ProfileLog

            self.profile_log = ProfileLog(args, model, main_params, config.profile_smoothing)

    def before(self, iteration: int) -> None:
        if self.freezer is not None:
            self.freezer.set(frozen_layers(self.freeze_steps, iteration))
        if self.pruning is not None:
            self.pruning.before(iteration)
        if self.profile_log is not None:
            self.profile_log.start(iteration)
        if self.token_counts is not None:
            self.token_counts.clear()

    def after(self, iteration: int) -> None:
        if self.profile_log is not None:
            self.profile_log.finish(iteration)
        if not _logged(self.args, iteration):
            return
        from megatron.core import parallel_state

        from megatron_slim.megatron.dynmo.token_counts import logs_tokens

        if not logs_tokens(parallel_state):
            return
        rank = dist.get_rank() if dist.is_initialized() else 0
        for piece in (self.token_counts, self.pruning):
            if piece is not None:
                print("\n".join(piece.lines(iteration, rank)), flush=True)


def _freezer(args, model, optimizer, main_params):
    from megatron_slim.megatron.dynmo.freeze import FrozenLayers, weight_grads_kept_by

    kept_by = weight_grads_kept_by(args)
    _say(
        "dynmo freeze: frozen layers skip their weight gradients"
        if kept_by is None
        else f"dynmo freeze: frozen layers compute weight gradients, dropped before the optimizer ({kept_by})"
    )
    return FrozenLayers(model, optimizer, main_params, skips_weight_grads=kept_by is None)


def _logged(args, iteration: int) -> bool:
    return iteration % (args.log_interval or 1) == 0 or iteration == args.train_iters


def _say(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


def dynmo_requested(args: Any) -> bool:
    if args is None:
        return False
    from megatron_slim.megatron.launch.dynmo_flags import dynmo_from_megatron_args

    return dynmo_from_megatron_args(args).active


def with_dynmo(train_step: Callable, args_getter: Callable[[], Optional[Any]]) -> Callable:
    """``train_step`` running the ``--dynmo-*`` pieces around each call (a no-op without them)."""
    signature = inspect.signature(train_step)
    runs: dict[int, LaunchDynmo] = {}  # id(optimizer) -> its run's pieces

    @functools.wraps(train_step)
    def dynmo_train_step(*call_args, **kwargs):
        args = args_getter()
        if not dynmo_requested(args):
            return train_step(*call_args, **kwargs)
        bound = signature.bind(*call_args, **kwargs).arguments
        model, optimizer = bound["model"], bound["optimizer"]
        run = runs.get(id(optimizer))
        if run is None or run.optimizer is not optimizer:
            run = runs[id(optimizer)] = LaunchDynmo(args, model, optimizer)
        iteration = int(getattr(args, "curr_iteration", 0)) + 1
        run.before(iteration)
        result = train_step(*call_args, **kwargs)
        run.after(iteration)
        return result

    return dynmo_train_step
