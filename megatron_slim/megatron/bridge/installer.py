"""SlimPipe under Megatron-Bridge's own training loop (``megatron.bridge.training.pretrain``).

The launcher's hooks (``hooks.py``) read Megatron-LM's parsed flags; Bridge parses none (a run is
a ``ConfigContainer``), so they cannot reach it. Call ``install`` after building the config and
before ``pretrain(config, forward_step)``::

    from megatron_slim.megatron import bridge
    bridge.install(config, num_slices=8, slice_policy="balanced", hardware="h100")

* **checks** (``bridge.config.check_config``): ``ConfigError`` naming the config field or argument,
  raised before anything is patched;
* **layer spec**: ``config.model.transformer_layer_spec`` (a ``ModuleSpec``, a callable of the
  model config with or without ``vp_stage``, or ``None``: ``GPTModelConfig``'s default) becomes a
  callable that resolves it the way Bridge does and puts ``SliceCoreAttention`` in the result;
* **schedule**: Bridge's ``train()`` and ``evaluate()`` call ``get_forward_backward_func`` bound by
  name from ``megatron.core.pipeline_parallel(.schedules)``; it is replaced in every module already
  imported (Bridge's ``train``/``eval`` included) and in megatron-core, where later imports find it,
  by one that returns the SlimPipe function (``make_forward_backward_func``).

Bridge's ``get_batch`` reads the iterator on every tensor-parallel rank (no broadcast: the
launcher's TP hook has nothing to do) and cuts each slice over context-parallel ranks with
megatron-core's ``get_batch_on_this_cp_rank``, as SlimPipe expects. ``BridgeInstall.remove()`` puts
the config's spec and the function back. See docs/megatron-bridge.md.
"""

from __future__ import annotations

import importlib
import inspect
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

from megatron_slim.megatron.bridge.config import SlimPipeOptions, check_config
from megatron_slim.megatron.rebind import replace_everywhere

SCHEDULES_MODULE = "megatron.core.pipeline_parallel.schedules"
_MARK = "_megatron_slim_bridge"


def _resolve_spec(spec: Any, model_config: Any, vp_stage: Optional[int]) -> Any:
    """The layer spec Bridge's builders would get from ``spec`` (gpt_provider.py ``provide``,
    megatron.training.models.gpt ``GPTModelBuilder.build_model``)."""
    if spec is None:  # GPTModelConfig's default
        default = importlib.import_module("megatron.training.models.gpt").default_layer_spec
        return default(model_config, vp_stage)
    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(spec, ModuleSpec):
        return spec
    if "vp_stage" in inspect.signature(spec).parameters:
        return spec(model_config, vp_stage=vp_stage)
    return spec(model_config)


def slice_attention_spec(original: Any) -> Callable:
    """A ``transformer_layer_spec`` callable: ``original`` resolved, with SliceCoreAttention."""
    from megatron_slim.megatron.slimpipe.hooks import with_slice_attention

    def transformer_layer_spec(model_config: Any, vp_stage: Optional[int] = None) -> Any:
        return with_slice_attention(_resolve_spec(original, model_config, vp_stage))

    setattr(transformer_layer_spec, _MARK, original)
    return transformer_layer_spec


def _schedule_getter(function: Callable) -> Callable:
    from megatron_slim.megatron.slimpipe.call_plan import check_schedule_groups

    def get_forward_backward_func(*args: Any, **kwargs: Any) -> Callable:
        check_schedule_groups(*args, **kwargs)
        return function

    setattr(get_forward_backward_func, _MARK, True)
    return get_forward_backward_func


@dataclass
class BridgeInstall:
    """What ``install`` changed; ``remove()`` restores it."""

    forward_backward_func: Callable
    model: Any
    original_spec: Any
    original_getter: Callable
    getter: Callable

    def remove(self) -> None:
        self.model.transformer_layer_spec = self.original_spec
        replace_everywhere(self.getter, self.original_getter)


def install(
    config: Any,
    *,
    num_slices: int,
    slice_policy: str = "uniform",
    hardware: str = "h100",
    calibration: Optional[str] = None,
    attention_backend: str = "auto",
    vocab_parallel: bool = False,
) -> BridgeInstall:
    """Make Bridge's ``pretrain(config, ...)`` run SlimPipe with ``num_slices`` slices per microbatch
    (``slice_policy`` ``uniform`` or ``balanced``: equal work under the causal mask, from the cost
    model of ``hardware`` / measured ``calibration``; ``vocab_parallel``: the embedding and output
    layer on every pipeline rank: not run under Bridge yet, so refused). Raises ``ConfigError`` before changing
    anything when the config cannot run under SlimPipe."""
    from megatron_slim.megatron.slimpipe.hooks import slimpipe_settings
    from megatron_slim.megatron.slimpipe.schedule import make_forward_backward_func

    options = SlimPipeOptions(num_slices, slice_policy, hardware, calibration, attention_backend, vocab_parallel)
    args = check_config(config, options)
    settings = slimpipe_settings(args)
    schedules = importlib.import_module(SCHEDULES_MODULE)
    original_getter = schedules.get_forward_backward_func
    if getattr(original_getter, _MARK, False):
        raise RuntimeError(
            "megatron_slim.megatron.bridge.install: already installed in this process; call "
            "remove() on the BridgeInstall it returned first"
        )
    function = make_forward_backward_func(settings)
    getter = _schedule_getter(function)
    model = config.model
    handle = BridgeInstall(function, model, model.transformer_layer_spec, original_getter, getter)
    model.transformer_layer_spec = slice_attention_spec(handle.original_spec)
    replace_everywhere(original_getter, getter)
    if os.environ.get("RANK", "0") == "0":
        print(
            f"megatron-slim: SlimPipe under Megatron-Bridge, {settings.num_slices} {slice_policy} slice(s) per "
            f"microbatch of {args.seq_length} tokens: {list(settings.slice_lengths)}",
            flush=True,
        )
    return handle
