"""``--dynmo-profile`` and ``--dynmo-freeze`` around Megatron-LM's ``train_step``.

``train_step(forward_step_func, data_iterator, model, optimizer, ...)`` is the one call per
iteration that sees the built model chunks and optimizer, on every Megatron-LM release; the wrapper
sets up the profiler and the freezer on its first call, applies the freeze schedule for the
iteration before it (iterations 1-based, as Megatron logs them: ``args.curr_iteration + 1``), and
closes the iteration's profile after it.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Optional

from megatron_slim.plan.dynmo.options import frozen_layers


class LaunchDynmo:
    """The dynmo pieces of one ``pretrain()`` run, built from its parsed args, model and optimizer."""

    def __init__(self, args, model, optimizer) -> None:
        from megatron_slim.megatron.dynmo.freeze import FrozenLayers
        from megatron_slim.megatron.dynmo.main_params import MainParams
        from megatron_slim.megatron.launch.dynmo_flags import dynmo_from_megatron_args

        config = dynmo_from_megatron_args(args)
        self.args = args
        self.optimizer = optimizer
        main_params = MainParams(optimizer)
        self.freeze_steps = config.freeze_steps(args.num_layers)
        self.freezer = FrozenLayers(model, optimizer, main_params) if self.freeze_steps else None
        self.profile_log = None
        if config.profile:
            from megatron_slim.megatron.dynmo.profile_log import ProfileLog

            self.profile_log = ProfileLog(args, model, main_params, config.profile_smoothing)

    def before(self, iteration: int) -> None:
        if self.freezer is not None:
            self.freezer.set(frozen_layers(self.freeze_steps, iteration))
        if self.profile_log is not None:
            self.profile_log.start(iteration)

    def after(self, iteration: int) -> None:
        if self.profile_log is not None:
            self.profile_log.finish(iteration)


def dynmo_requested(args: Any) -> bool:
    return args is not None and bool(getattr(args, "dynmo_profile", False) or getattr(args, "dynmo_freeze", ""))


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
