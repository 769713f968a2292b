"""Version shims for megatron-core 0.14 .. 0.19: one function per API that moved.

Every shim decides by *feature detection* (the installed function's signature, or whether an
attribute exists), never by version string, so patch releases and backports are handled. Each
shim takes an optional ``fn`` / module argument so tests can hand it fakes of every historical
signature; without it the installed megatron-core is imported lazily (importing this module does
not import megatron).

The historical shapes (see ``/work/shared/notes/megatron-core.md``):

- ``backward_step``: 0.14 ``(input_tensor, output_tensor, output_tensor_grad, model_type, config,
  pipeline_model_parallel_size=1)``; 0.15-0.16 ``(..., model_type, config)``; 0.17+
  ``(input_tensor, output_tensor, output_tensor_grad, config)``.
- model-level process groups keyword: ``model_comm_pgs=`` (0.14) vs ``pg_collection=`` (0.15+).
- ``finalize_model_grads``: 0.14 ``grad_finalize_pgs=``, 0.15+ ``pg_collection=``, 0.16+
  ``force_all_reduce=``.
- local layer spec: ``get_gpt_layer_local_spec`` (0.14-0.16) vs ``get_gpt_layer_local_submodules``
  (0.17+, the spec function becomes a wrapper).
- ``TransformerLayer._forward_mlp``: 0.14/0.15 ``(hidden_states, inference_context=None)``,
  0.16-0.18 ``+ padding_mask=None``, 0.19 ``+ packed_seq_params=None``.
- building from a spec: ``build_module(spec, ...)`` everywhere; ``ModuleSpec.__call__`` from 0.16.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
from typing import Any, Callable, Mapping, Optional

# Keywords naming the model-level process-group object, newest first.
MODEL_GROUPS_KEYWORDS = ("pg_collection", "model_comm_pgs")
# Keywords naming the grad-finalisation process-group object, newest first.
GRAD_FINALIZE_KEYWORDS = ("pg_collection", "grad_finalize_pgs")


# --------------------------------------------------------------------------- signature helpers


def _parameters(fn: Callable) -> Mapping[str, inspect.Parameter]:
    return inspect.signature(fn).parameters


def has_parameter(fn: Callable, name: str) -> bool:
    """True if ``fn`` declares a parameter called ``name`` (``**kwargs`` does not count)."""
    param = _parameters(fn).get(name)
    return param is not None and param.kind not in (param.VAR_POSITIONAL, param.VAR_KEYWORD)


def takes_var_keywords(fn: Callable) -> bool:
    return any(p.kind == p.VAR_KEYWORD for p in _parameters(fn).values())


def supported_kwargs(fn: Callable, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The subset of ``kwargs`` that ``fn`` accepts (all of them if it takes ``**kwargs``)."""
    if takes_var_keywords(fn):
        return dict(kwargs)
    return {k: v for k, v in kwargs.items() if has_parameter(fn, k)}


def call_with_supported(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """Call ``fn``, dropping keyword arguments the installed version does not know.

    Only for optional settings whose absence means "the old default" (e.g.
    ``create_gloo_process_groups``); anything whose meaning matters gets its own shim below.
    """
    return fn(*args, **supported_kwargs(fn, kwargs))


def _first_declared(fn: Callable, candidates: tuple[str, ...]) -> Optional[str]:
    for name in candidates:
        if has_parameter(fn, name):
            return name
    return None


# --------------------------------------------------------------------------- version


def mcore_version() -> tuple[int, int, int]:
    """The installed megatron-core version as ``(major, minor, patch)``."""
    from megatron.core import package_info

    major, minor, patch = (int(str(x).split("rc")[0]) for x in package_info.VERSION[:3])
    return major, minor, patch


# --------------------------------------------------------------------------- pipeline steps


def _schedules():
    return importlib.import_module("megatron.core.pipeline_parallel.schedules")


def backward_step(
    input_tensor,
    output_tensor,
    output_tensor_grad,
    config,
    *,
    model_type: Any = None,
    pipeline_model_parallel_size: int = 1,
    fn: Optional[Callable] = None,
):
    """megatron's ``backward_step`` with the arguments the installed version expects.

    ``model_type`` defaults to ``ModelType.encoder_or_decoder`` where it is still required.
    """
    fn = fn or _schedules().backward_step
    if not has_parameter(fn, "model_type"):  # 0.17+
        return fn(input_tensor, output_tensor, output_tensor_grad, config)
    if model_type is None:
        from megatron.core.enums import ModelType

        model_type = ModelType.encoder_or_decoder
    args = (input_tensor, output_tensor, output_tensor_grad, model_type, config)
    if has_parameter(fn, "pipeline_model_parallel_size"):  # 0.14
        return fn(*args, pipeline_model_parallel_size=pipeline_model_parallel_size)
    return fn(*args)


def forward_step(*, fn: Optional[Callable] = None, **kwargs: Any):
    """megatron's ``forward_step``, called by keyword; optional keywords the installed version
    lacks (e.g. ``is_last_stage``, ``vp_stage``) are dropped so it falls back to its default."""
    fn = fn or _schedules().forward_step
    return call_with_supported(fn, **kwargs)


def finalize_model_grads_kwargs(
    fn: Callable, groups: Any = None, force_all_reduce: Optional[bool] = None
) -> dict[str, Any]:
    """Keyword arguments for ``fn`` (a ``finalize_model_grads``-like callable).

    ``groups`` may be our :class:`~megatron_slim.megatron.model.parallel.ParallelGroups` (converted to
    the class the keyword expects) or an already-built megatron object (passed through).
    """
    kwargs: dict[str, Any] = {}
    if groups is not None:
        keyword = _first_declared(fn, GRAD_FINALIZE_KEYWORDS)
        if keyword is None and takes_var_keywords(fn):
            keyword = GRAD_FINALIZE_KEYWORDS[0]
        if keyword is None:
            raise TypeError(
                f"{getattr(fn, '__name__', fn)!r} takes no process-group keyword "
                f"(looked for {', '.join(GRAD_FINALIZE_KEYWORDS)})"
            )
        kwargs[keyword] = _convert_groups(groups, lambda: _grad_finalize_groups_class(keyword))
    if force_all_reduce is not None:
        if has_parameter(fn, "force_all_reduce") or takes_var_keywords(fn):
            kwargs["force_all_reduce"] = force_all_reduce
        elif force_all_reduce:
            raise ValueError(
                "force_all_reduce=True: allowed only with megatron-core >= 0.16 (the "
                "installed finalize_model_grads has no such keyword); use None/False"
            )
    return kwargs


def finalize_model_grads(
    model_chunks: list,
    num_tokens=None,
    *,
    groups: Any = None,
    force_all_reduce: Optional[bool] = None,
    fn: Optional[Callable] = None,
):
    """Call ``finalize_model_grads`` (or ``config.finalize_model_grads_func``) portably."""
    if fn is None:
        fn = importlib.import_module("megatron.core.distributed").finalize_model_grads
    return fn(model_chunks, num_tokens, **finalize_model_grads_kwargs(fn, groups, force_all_reduce))


# --------------------------------------------------------------------------- process groups


def _process_groups_config():
    return importlib.import_module("megatron.core.process_groups_config")


def model_groups_class() -> type:
    """megatron's model-level process-group dataclass: ``ProcessGroupCollection`` (0.15+) or
    ``ModelCommProcessGroups`` (0.14)."""
    module = _process_groups_config()
    return getattr(module, "ProcessGroupCollection", None) or module.ModelCommProcessGroups


def _grad_finalize_groups_class(keyword: str):
    module = _process_groups_config()
    if keyword == "grad_finalize_pgs" and hasattr(module, "GradFinalizeProcessGroups"):
        return module.GradFinalizeProcessGroups
    return model_groups_class()


def _convert_groups(groups: Any, target_class: Callable[[], type]) -> Any:
    """Our ParallelGroups become megatron's dataclass ``target_class()``; megatron objects pass
    through unchanged."""
    as_megatron = getattr(groups, "as_megatron", None)
    if as_megatron is None:
        return groups
    return as_megatron(target_class())


def fill_groups_dataclass(cls: type, values: Mapping[str, Any]) -> Any:
    """Instantiate one of megatron's process-group dataclasses (all fields ``init=False``) and set
    the fields that ``values`` provides; fields it lacks stay unset, as megatron expects."""
    obj = cls()
    for f in dataclasses.fields(cls):
        if f.name in values:
            setattr(obj, f.name, values[f.name])
    return obj


def model_groups_keyword(target: Callable) -> Optional[str]:
    """The keyword through which ``target`` (a megatron module class or function) receives the
    model-level process groups: ``pg_collection`` (0.15+), ``model_comm_pgs`` (0.14) or None."""
    init = target.__init__ if inspect.isclass(target) else target
    return _first_declared(init, MODEL_GROUPS_KEYWORDS)


def model_groups_kwargs(target: Callable, groups: Any) -> dict[str, Any]:
    """``{keyword: groups-object}`` for constructing ``target`` (e.g. ``GPTModel``, a core
    attention) with explicit process groups, converted to the installed collection class."""
    keyword = model_groups_keyword(target)
    if keyword is None or groups is None:
        return {}
    return {keyword: _convert_groups(groups, model_groups_class)}


def core_attention_groups_keyword(attention_cls: Optional[type] = None) -> Optional[str]:
    """Which keyword megatron's ``Attention`` uses to hand process groups to core attention."""
    if attention_cls is None:
        attention_cls = importlib.import_module("megatron.core.transformer.attention").Attention
    return model_groups_keyword(attention_cls)


# --------------------------------------------------------------------------- layer specs


def local_layer_submodules(normalization: str = "RMSNorm", *, specs_module: Any = None):
    """``TransformerLayerSubmodules`` of megatron's local (non-TE) GPT layer."""
    if specs_module is None:
        specs_module = importlib.import_module("megatron.core.models.gpt.gpt_layer_specs")
    submodules_fn = getattr(specs_module, "get_gpt_layer_local_submodules", None)
    if submodules_fn is not None:  # 0.17+
        return submodules_fn(normalization=normalization)
    return specs_module.get_gpt_layer_local_spec(normalization=normalization).submodules


def build(spec_or_module: Any, *args: Any, spec_utils: Any = None, **kwargs: Any) -> Any:
    """Instantiate a ``ModuleSpec`` (or a class) the way the installed megatron-core does."""
    if spec_utils is None:
        spec_utils = importlib.import_module("megatron.core.transformer.spec_utils")
    build_module = getattr(spec_utils, "build_module", None)
    if build_module is not None:
        return build_module(spec_or_module, *args, **kwargs)
    return spec_or_module(*args, **kwargs)  # ModuleSpec.__call__ (0.16+) or a plain class


def forward_mlp(layer: Any, hidden_states, *, inference_context=None, padding_mask=None, packed_seq_params=None):
    """``layer._forward_mlp`` with the keywords its version knows.

    A keyword the installed version lacks may be omitted only while it is None: silently dropping
    a real padding mask or packed-sequence description would change the result.
    """
    fn = layer._forward_mlp
    kwargs: dict[str, Any] = {}
    for name, value in (
        ("inference_context", inference_context),
        ("padding_mask", padding_mask),
        ("packed_seq_params", packed_seq_params),
    ):
        if has_parameter(fn, name):
            kwargs[name] = value
        elif value is not None:
            raise ValueError(
                f"{name}: allowed value is None with the installed megatron-core "
                "(its TransformerLayer._forward_mlp does not take it)"
            )
    return fn(hidden_states, **kwargs)


@functools.cache
def transformer_config_fields() -> frozenset[str]:
    from megatron.core.transformer import TransformerConfig

    return frozenset(f.name for f in dataclasses.fields(TransformerConfig))


def without_deprecated_defaults(config_cls) -> dict:
    """Fields whose megatron-core default is itself deprecated, set to what the default means.

    megatron-core 0.16+ declares ``cuda_graph_scope="full"`` and, in ``__post_init__``, turns it into
    ``[]`` ("the whole layer") with a deprecation warning, once per config and rank; ``[]`` is the
    same setting without the warning. Older releases (a plain string field) keep their default."""
    field = {f.name: f for f in dataclasses.fields(config_cls)}.get("cuda_graph_scope")
    if field is not None and field.default == "full" and "List" in str(field.type):
        return {"cuda_graph_scope": []}
    return {}
