"""What one SlimPipe call plans before it runs: the schedule every pipeline rank executes, the
check that all ranks hold the same one, and the refusals of what a call asks for that SlimPipe
cannot run."""

from __future__ import annotations

from typing import Any

import torch

from megatron_slim.megatron.slimpipe.settings import RunStats, SlimPipeSettings
from megatron_slim.plan.recipe import Recipe
from megatron_slim.plan.schedule.executable import executable, executable_with_exchange
from megatron_slim.plan.schedule.ir import Schedule
from megatron_slim.plan.sim.exchange_timing import timed_exchange_schedule
from megatron_slim.runtime.agreement import check_agreement


def pipeline_group(pg_collection, p2p_communicator):
    for source in (pg_collection, p2p_communicator):
        group = getattr(source, "pp", None) or getattr(source, "pp_group", None)
        if group is not None:
            return group
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_group()


def tensor_group(pg_collection):
    """This rank's tensor-parallel group (None without one)."""
    group = getattr(pg_collection, "tp", None)
    if group is not None:
        return group
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group(check_initialized=False)


def agree_on_plan(digest: str, group, stats: RunStats, device: torch.device) -> None:
    if digest in stats.agreed_digests or group.size() == 1:
        return
    check_agreement(
        digest,
        group,
        device=device,
        ranks="pipeline ranks",
        what="SlimPipe schedule",
        remedy="every rank must generate it from the same schedule settings",
    )
    stats.agreed_digests.add(digest)


def check_schedule_groups(*args: Any, **kwargs: Any) -> None:
    """Refuse what ``get_forward_backward_func(*args, **kwargs)`` asks for that SlimPipe cannot run:
    0.19's ``schedule_pg_collection`` (third positional) as a ``MultiModuleProcessGroupCollection``
    (pipelines of several modules, e.g. a vision encoder before the language model)."""
    groups = kwargs.get("schedule_pg_collection", args[2] if len(args) > 2 else None)
    if type(groups).__name__ == "MultiModuleProcessGroupCollection":
        raise ValueError(
            "--use-slimpipe: multi-module pipelines (a MultiModuleProcessGroupCollection from "
            "get_forward_backward_func(schedule_pg_collection=...)) are not supported; allowed: one "
            "GPT model per pipeline rank"
        )


def planned_schedule(
    settings: SlimPipeSettings, pp: int, vpp: int, num_microbatches: int, forward_only: bool = False
) -> Schedule:
    """The schedule every pipeline rank runs for one call (the simulator times the same one); with
    ``settings.exchange`` a training call's carries its context-exchange pairs (an evaluation has none):
    timed with ``settings.exchange_recipe``'s cost model where given, as ``megatron-slim simulate`` does."""
    if settings.exchange and not forward_only and pp > 1:
        recipe = settings.exchange_recipe
        if recipe is None:
            return executable_with_exchange(settings.kind, pp, vpp, num_microbatches, settings.slice_lengths)
        _check_recipe_shape(recipe, settings, pp, vpp)
        return timed_exchange_schedule(recipe, num_microbatches, settings.slice_lengths)
    return executable(settings.kind, pp, vpp, num_microbatches, settings.num_slices)


def _check_recipe_shape(recipe: Recipe, settings: SlimPipeSettings, pp: int, vpp: int) -> None:
    """The timed pairing is planned for the recipe's pipeline; a call on another one cannot run it."""
    p = recipe.parallel
    if (p.pp, p.vpp, recipe.schedule.kind) != (pp, vpp, settings.kind):
        raise ValueError(
            f"schedule.slice_policy=exchange: the pairing is timed for parallel.pp={p.pp}, parallel.vpp={p.vpp}, "
            f"schedule.kind={recipe.schedule.kind}, but this call runs pp={pp}, vpp={vpp}, kind={settings.kind}; "
            "allowed: the recipe's own pipeline"
        )


def refuse_unsupported_call(settings: SlimPipeSettings, seq_length: int, adjust_tensor_shapes_fn) -> None:
    if adjust_tensor_shapes_fn is not None:
        raise ValueError(
            "adjust_tensor_shapes_fn: not supported by SlimPipe (ModelOpt distillation); run without --use-slimpipe"
        )
    if sum(settings.slice_lengths) != seq_length:
        raise ValueError(
            f"seq_length={seq_length}: the SlimPipe slice plan covers "
            f"{sum(settings.slice_lengths)} tokens ({settings.slice_lengths})"
        )
