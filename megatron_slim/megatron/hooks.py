"""Hook megatron-slim into Megatron-LM's training loop without editing ``pretrain_gpt.py``.

Each hook is a no-op unless the parsed args ask for megatron-slim:

* flags: ``megatron.training.arguments.parse_args`` (bound by name in ``initialize``, called by
  ``parse_and_validate_args`` on 0.18+ and by ``inprocess_restart``'s pre-parse on 0.17 and
  older) gets ``add_arguments`` appended to whatever ``extra_args_provider`` the script passes;
  registering is idempotent, so nested parses never register a flag twice;
* start-up checks: ``validate_args`` runs ``check_megatron_args`` right after Megatron's own
  validation (which settles defaults such as ``overlap_p2p_comm``), before any model is built;
* schedule: ``megatron.training.training.get_forward_backward_func``, the name ``train()`` and
  ``evaluate()`` call, returns the SlimPipe function when ``--use-slimpipe`` is set; it accepts
  every version's keywords (``pp_size``, ``vp_size``, ``schedule_pg_collection``);
* layer specs: megatron-core's GPT layer-spec builders return specs whose core attention is
  ``SliceCoreAttention``; builders already imported by name elsewhere (``gpt_builders``) are
  patched there too;
* tensor-parallel batch broadcast: under SlimPipe the data iterator yields one slice per forward
  step, and ``get_batch_on_this_tp_rank`` (``megatron.training.utils`` up to 0.17,
  ``megatron.core.utils`` from 0.18) is told the current slice's length, so TP ranks other than 0
  allocate slice-sized receive buffers for what TP rank 0 broadcasts.

With ``--cp-engine`` other than ``te`` (and ``--context-parallel-size > 1``) the same hooks serve
megatron-slim's CP engines instead (``cp/hooks.py``): the spec gets ``CPCoreAttention`` (and
``RemapTransformerLayer`` for ``--cp-remap``), the schedule Megatron picked is wrapped to attach the
engine's context and normalise the loss CP-wide, and ``get_batch_on_this_cp_rank`` -- the name
``pretrain_gpt.get_batch`` calls -- plans each pack and returns this rank's part of it. With
``--use-slimpipe`` too, SlimPipe's schedule runs and its slices follow the engine's plan of each
window (``slimpipe/engine_slices.py``: each call's windows planned up front, each slice cut to this
CP rank's share of the plan).

* dynmo: ``train_step`` (``megatron.training.training``) runs ``--dynmo-profile``,
  ``--dynmo-freeze`` and the token counts around each iteration (``megatron/dynmo/hooks.py``); the
  layer-spec builders build every decoder layer as the early-exit or mixture-of-depths layer with
  ``--dynmo-exit-threshold`` / ``--dynmo-mod-capacity`` (``megatron/dynmo/layers.py``).

With ``--slimpipe-packing`` the train split's data loader serves packed windows instead
(``data/packed_windows.py``, hooked at ``build_pretraining_data_loader``).

``prepare_launch()`` installs them all before the script runs (``python -m megatron_slim.launch``);
``install(args)`` is the explicit form for a script that parsed its args itself (see
``patches/pretrain_gpt.patch``).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
from typing import Any, Callable, Optional

from megatron_slim.megatron.cp.hooks import CPHookState, cp_engine_active, with_cp_attention
from megatron_slim.megatron.dynmo.layers import with_dynamic_layer
from megatron_slim.megatron.launch.flags import add_arguments, check_megatron_args
from megatron_slim.megatron.rebind import replace_everywhere as _replace_everywhere
from megatron_slim.megatron.slimpipe.hooks import SlimPipeHookState, with_slice_attention, with_slice_length

SPEC_BUILDERS = (
    "get_gpt_layer_with_transformer_engine_spec",
    "get_gpt_layer_local_spec",
    "get_gpt_layer_with_transformer_engine_submodules",
    "get_gpt_layer_local_submodules",
)
_MARK = "_megatron_slim_hook"


def _megatron_args() -> Optional[Any]:
    try:
        from megatron.training.global_vars import get_args

        return get_args()
    except (ImportError, AssertionError):
        return None


def _wrap_where_defined(modules: tuple[str, ...], name: str, wrap: Callable[[Callable], Callable]) -> None:
    """Replace function ``name`` in each of ``modules`` that defines it (its home moved between
    releases) with ``wrap(original)``, and every name already bound to it; later imports bind the
    replacement."""
    for module_name in modules:
        if importlib.util.find_spec(module_name) is None:
            continue
        original = getattr(importlib.import_module(module_name), name, None)
        if original is None or getattr(original, _MARK, False):
            continue
        replacement = wrap(original)
        setattr(replacement, _MARK, True)
        _replace_everywhere(original, replacement)


# ---- flags and start-up checks -------------------------------------------------------------
def _with_our_flags(extra_args_provider):
    def provider(parser):
        if extra_args_provider is not None:
            parser = extra_args_provider(parser)
        return add_arguments(parser)

    return provider


def _patch_arguments() -> None:
    arguments = importlib.import_module("megatron.training.arguments")
    importlib.import_module("megatron.training.initialize")
    original_parse = arguments.parse_args
    if not getattr(original_parse, _MARK, False):

        @functools.wraps(original_parse)
        def parse_args(extra_args_provider=None, *args, **kwargs):
            return original_parse(_with_our_flags(extra_args_provider), *args, **kwargs)

        setattr(parse_args, _MARK, True)
        _replace_everywhere(original_parse, parse_args)

    original_validate = arguments.validate_args
    if not getattr(original_validate, _MARK, False):

        @functools.wraps(original_validate)
        def validate_args(args, *rest, **kwargs):
            result = original_validate(args, *rest, **kwargs)
            check_megatron_args(args)
            return result

        setattr(validate_args, _MARK, True)
        _replace_everywhere(original_validate, validate_args)


# ---- schedule --------------------------------------------------------------------------------
def _patch_schedule(slim_state: SlimPipeHookState, cp_state: CPHookState) -> None:
    training: Any = importlib.import_module("megatron.training.training")
    original = training.get_forward_backward_func
    if getattr(original, _MARK, False):
        return

    def get_forward_backward_func(*args: Any, **kwargs: Any):
        parsed = slim_state.args_getter()
        if slim_state.active_args() is None:
            chosen = original(*args, **kwargs)
            return cp_state.wrap_forward_backward(chosen) if cp_engine_active(parsed) else chosen
        from megatron_slim.megatron.slimpipe.call_plan import check_schedule_groups

        check_schedule_groups(*args, **kwargs)
        return slim_state.forward_backward_func(parsed)

    setattr(get_forward_backward_func, _MARK, True)
    _replace_everywhere(original, get_forward_backward_func)
    training.get_forward_backward_func = get_forward_backward_func


# ---- tensor-parallel batch broadcast ---------------------------------------------------------
TP_BATCH_MODULES = ("megatron.training.utils", "megatron.core.utils")


def _patch_tp_batch(slim_state: SlimPipeHookState) -> None:
    _wrap_where_defined(
        TP_BATCH_MODULES, "get_batch_on_this_tp_rank", lambda original: with_slice_length(original, slim_state)
    )


# ---- layer specs -----------------------------------------------------------------------------
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
                spec = with_slice_attention(spec)
            elif cp_engine_active(parsed):
                spec = with_cp_attention(spec, remap=bool(parsed.cp_remap))
            return with_dynamic_layer(spec, parsed)

        setattr(builder, _MARK, True)
        _replace_everywhere(original, builder)


# ---- CP batch split --------------------------------------------------------------------------
CP_BATCH_MODULES = ("megatron.core.utils", "megatron.training.utils")


def _patch_cp_batch(cp_state: CPHookState, slim_state: SlimPipeHookState) -> None:
    """Replace ``get_batch_on_this_cp_rank`` where it is defined (megatron-core 0.16:
    ``megatron.core.utils``; Megatron-LM main: ``megatron.training.utils``) and every name bound to
    it; scripts imported later bind the replacement. Under SlimPipe slices that follow a CP engine's
    plans it cuts each slice to this CP rank's share (``slimpipe/engine_slices.py``)."""
    engine_slices = slim_state.engine_slices
    assert engine_slices is not None

    def wrap(original: Callable) -> Callable:
        return engine_slices.wrap_batch_split(cp_state.wrap_batch_split(original))

    _wrap_where_defined(CP_BATCH_MODULES, "get_batch_on_this_cp_rank", wrap)


# ---- dynmo: profiling and freezing around each training step -------------------------------
def _patch_train_step(args_getter: Callable[[], Any]) -> None:
    from megatron_slim.megatron.dynmo.hooks import with_dynmo

    _wrap_where_defined(
        ("megatron.training.training",), "train_step", lambda original: with_dynmo(original, args_getter)
    )


# ---- packed training windows (--slimpipe-packing) -------------------------------------------
DATA_LOADER_MODULES = ("megatron.training.datasets.data_samplers",)


def _patch_data_loader(args_getter: Callable[[], Any]) -> None:
    from megatron_slim.megatron.data.packed_windows import with_packed_windows

    def wrap(original: Callable) -> Callable:
        return with_packed_windows(original, args_getter)

    _wrap_where_defined(DATA_LOADER_MODULES, "build_pretraining_data_loader", wrap)


# ---- entry points ----------------------------------------------------------------------------
def _install_all(args_getter: Callable[[], Any]) -> None:
    cp_state = CPHookState(args_getter)
    slim_state = SlimPipeHookState(args_getter, plan_inputs=cp_state.plan_inputs)
    _patch_schedule(slim_state, cp_state)
    _patch_layer_specs(args_getter)
    _patch_tp_batch(slim_state)
    _patch_cp_batch(cp_state, slim_state)
    _patch_train_step(args_getter)
    _patch_data_loader(args_getter)


def prepare_launch() -> None:
    """Before Megatron-LM parses anything: hook flags, start-up checks, schedule, specs and the TP
    and CP batch paths (they read the parsed args when called; with megatron-slim flags on the
    command line and no parsed args, they refuse: ``launch.guard``)."""
    from megatron_slim.megatron.launch.guard import guarded

    _patch_arguments()
    _install_all(guarded(_megatron_args, sys.argv[1:]))


def install(args: Any = None) -> None:
    """For scripts that parsed their args already (``extra_args_provider=add_arguments``)."""
    args = args if args is not None else _megatron_args()
    if args is None:
        raise RuntimeError(
            "install(args): Megatron's args are not parsed yet; pass them or call after initialize_megatron"
        )
    check_megatron_args(args)
    _install_all(lambda: args)
