"""Hook megatron-slim into Megatron-LM's training loop without editing ``pretrain_gpt.py``.

Three hooks, each a no-op unless the parsed args ask for megatron-slim:

* flags: Megatron parses its own flags in ``megatron.training.arguments.parse_args`` (bound by
  name into ``megatron.training.initialize``); the wrapper adds ``add_arguments`` to whatever
  ``extra_args_provider`` the script passes and rejects unsupported combinations right after
  parsing, before any model is built;
* schedule: ``megatron.training.training.get_forward_backward_func``, the name ``train()`` and
  ``evaluate()`` call, returns the SlimPipe function when ``--use-slimpipe`` is set; it accepts
  every version's keywords (``pp_size``, ``vp_size``, ``schedule_pg_collection``);
* layer specs: megatron-core's GPT layer-spec builders return specs whose core attention is
  ``SliceCoreAttention``; builders already imported by name elsewhere (``gpt_builders``) are
  patched there too.

With ``--cp-engine`` other than ``te`` (and ``--context-parallel-size > 1``) the same hooks serve
megatron-slim's CP engines instead (``cp_hooks.py``): the spec gets ``CPCoreAttention`` (and
``RemapTransformerLayer`` for ``--cp-remap``), the schedule Megatron picked is wrapped to attach the
engine's context and normalise the loss CP-wide, and ``get_batch_on_this_cp_rank`` -- the name
``pretrain_gpt.get_batch`` calls -- plans each pack and returns this rank's part of it.

``prepare_launch()`` installs all three before the script runs (``python -m megatron_slim.launch``);
``install(args)`` is the explicit form for a script that parsed its args itself (see
``patches/pretrain_gpt.patch``).
"""
from __future__ import annotations

import copy
import functools
import importlib
import importlib.util
import sys
from typing import Any, Callable, Optional

from megatron_slim.megatron.cp_hooks import CPHookState, cp_engine_active, with_cp_attention
from megatron_slim.megatron.flags import add_arguments, check_megatron_args

SPEC_BUILDERS = ("get_gpt_layer_with_transformer_engine_spec", "get_gpt_layer_local_spec",
                 "get_gpt_layer_with_transformer_engine_submodules", "get_gpt_layer_local_submodules")
_MARK = "_megatron_slim_hook"


def _megatron_args() -> Optional[Any]:
    try:
        from megatron.training.global_vars import get_args

        return get_args()
    except (ImportError, AssertionError):
        return None


def _replace_everywhere(original: Callable, replacement: Callable) -> None:
    """Rebind every module-level name that refers to ``original`` (imports by name included)."""
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not namespace:
            continue
        for name, value in list(namespace.items()):
            if value is original:
                setattr(module, name, replacement)


# ---- flags -----------------------------------------------------------------------------------
def _with_our_flags(extra_args_provider):
    def provider(parser):
        if extra_args_provider is not None:
            parser = extra_args_provider(parser)
        return add_arguments(parser)

    return provider


def _patch_parse_args() -> None:
    arguments = importlib.import_module("megatron.training.arguments")
    importlib.import_module("megatron.training.initialize")
    for name in ("parse_args", "parse_and_validate_args"):
        original = getattr(arguments, name, None)
        if original is None or getattr(original, _MARK, False):
            continue

        @functools.wraps(original)
        def parse(extra_args_provider=None, *args, __original=original, **kwargs):
            parsed = __original(_with_our_flags(extra_args_provider), *args, **kwargs)
            check_megatron_args(parsed)
            return parsed

        setattr(parse, _MARK, True)
        _replace_everywhere(original, parse)


# ---- schedule --------------------------------------------------------------------------------
def slimpipe_settings(args) -> "SlimPipeSettings":
    """The slice plan a Megatron run uses, from its flags (balanced slices need the cost model)."""
    from megatron_slim.megatron.flags import recipe_from_megatron_args
    from megatron_slim.megatron.schedule import SlimPipeSettings
    from megatron_slim.plan.cost.calibration import load_calibration
    from megatron_slim.plan.cost.model import CostModel
    from megatron_slim.plan.sim.costs import slice_lengths

    recipe = recipe_from_megatron_args(args)
    calibration = (load_calibration(args.slimpipe_calibration, "--slimpipe-calibration")
                   if args.slimpipe_calibration else None)
    lengths = slice_lengths(recipe, CostModel(recipe, calibration=calibration))
    backend = None if args.megatron_slim_attention_backend == "auto" else args.megatron_slim_attention_backend
    return SlimPipeSettings(lengths, attention_backend=backend)


def _patch_schedule(args_getter: Callable[[], Any], cp_state: CPHookState) -> None:
    training = importlib.import_module("megatron.training.training")
    original = training.get_forward_backward_func
    if getattr(original, _MARK, False):
        return
    cache: dict[int, Callable] = {}

    def get_forward_backward_func(*args: Any, **kwargs: Any):
        parsed = args_getter()
        if parsed is None or not getattr(parsed, "use_slimpipe", False):
            chosen = original(*args, **kwargs)
            return cp_state.wrap_forward_backward(chosen) if cp_engine_active(parsed) else chosen
        if id(parsed) not in cache:
            from megatron_slim.megatron.schedule import make_forward_backward_func

            cache[id(parsed)] = make_forward_backward_func(slimpipe_settings(parsed))
        return cache[id(parsed)]

    setattr(get_forward_backward_func, _MARK, True)
    _replace_everywhere(original, get_forward_backward_func)
    training.get_forward_backward_func = get_forward_backward_func


# ---- layer specs -----------------------------------------------------------------------------
def with_slice_attention(spec: Any) -> Any:
    """A copy of a layer spec / submodules / block spec with SliceCoreAttention as core attention."""
    from megatron_slim.megatron.slicing import SliceCoreAttention

    spec = copy.deepcopy(spec)
    for layer in getattr(spec, "layer_specs", None) or [spec]:
        sub = getattr(layer, "submodules", layer)
        attention = getattr(sub, "self_attention", None)
        attention_sub = getattr(attention, "submodules", None)
        if attention_sub is None or not hasattr(attention_sub, "core_attention"):
            raise ValueError("--use-slimpipe: this layer spec has no self_attention.core_attention slot "
                             f"to put SliceCoreAttention in ({type(layer).__name__})")
        attention_sub.core_attention = SliceCoreAttention
    return spec


def _patch_layer_specs(args_getter: Callable[[], Any]) -> None:
    specs = importlib.import_module("megatron.core.models.gpt.gpt_layer_specs")
    for name in SPEC_BUILDERS:
        original = getattr(specs, name, None)
        if original is None or getattr(original, _MARK, False):
            continue

        @functools.wraps(original)
        def builder(*args, __original=original, **kwargs):
            spec = __original(*args, **kwargs)
            parsed = args_getter()
            if parsed is not None and parsed.use_slimpipe:
                return with_slice_attention(spec)
            if cp_engine_active(parsed):
                return with_cp_attention(spec, remap=bool(parsed.cp_remap))
            return spec

        setattr(builder, _MARK, True)
        _replace_everywhere(original, builder)


# ---- CP batch split --------------------------------------------------------------------------
CP_BATCH_MODULES = ("megatron.core.utils", "megatron.training.utils")


def _patch_cp_batch(cp_state: CPHookState) -> None:
    """Replace ``get_batch_on_this_cp_rank`` where it is defined (megatron-core 0.16:
    ``megatron.core.utils``; Megatron-LM main: ``megatron.training.utils``) and every name bound to
    it; scripts imported later bind the replacement."""
    for name in CP_BATCH_MODULES:
        if importlib.util.find_spec(name) is None:
            continue
        module = importlib.import_module(name)
        original = getattr(module, "get_batch_on_this_cp_rank", None)
        if original is None or getattr(original, _MARK, False):
            continue
        replacement = cp_state.wrap_batch_split(original)
        setattr(replacement, _MARK, True)
        _replace_everywhere(original, replacement)


# ---- entry points ----------------------------------------------------------------------------
def prepare_launch() -> None:
    """Before Megatron-LM parses anything: hook flags, schedule, specs and the CP batch split (they
    read the parsed args when called)."""
    _patch_parse_args()
    cp_state = CPHookState(_megatron_args)
    _patch_schedule(_megatron_args, cp_state)
    _patch_layer_specs(_megatron_args)
    _patch_cp_batch(cp_state)


def install(args: Any = None) -> None:
    """For scripts that parsed their args already (``extra_args_provider=add_arguments``)."""
    args = args if args is not None else _megatron_args()
    if args is None:
        raise RuntimeError("install(args): Megatron's args are not parsed yet; pass them or call after "
                           "initialize_megatron")
    check_megatron_args(args)
    cp_state = CPHookState(lambda: args)
    _patch_schedule(lambda: args, cp_state)
    _patch_layer_specs(lambda: args)
    _patch_cp_batch(cp_state)
