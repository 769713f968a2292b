"""Build frozen dataclasses from plain dicts, naming the bad field, value and allowed values.

Recipes (YAML) and ``--set key=value`` overrides both go through here, so every user-caused
config error has the same shape: ``<dotted.field>: <problem> (got <value>; allowed: ...)``.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import TYPE_CHECKING, Any, Callable, Literal, Mapping, TypeVar, get_args, get_origin, get_type_hints

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


class ConfigError(ValueError):
    """A recipe, override or argument names a field, value or combination that is not allowed."""


T = TypeVar("T", bound="DataclassInstance")


def fail(field: str, value: Any, allowed: str, problem: str = "invalid value") -> ConfigError:
    return ConfigError(f"{field}: {problem} (got {value!r}; allowed: {allowed})")


def check_fields(obj: object, prefix: str, names: tuple[str, ...], bad: Callable[[Any], bool], allowed: str) -> None:
    """Raise ``fail(prefix + name, ...)`` for the first of ``names`` whose value on ``obj`` is ``bad``."""
    for name in names:
        value = getattr(obj, name)
        if bad(value):
            raise fail(f"{prefix}{name}", value, allowed)


def _describe(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in get_args(tp))
    if origin is tuple:
        return f"list of {_describe(get_args(tp)[0])}"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return f"mapping with keys {', '.join(f.name for f in dataclasses.fields(tp))}"
    return getattr(tp, "__name__", str(tp))


def coerce(tp: Any, value: Any, field: str) -> Any:
    """Check ``value`` against annotation ``tp``; convert where YAML/CLI spelling differs."""
    origin = get_origin(tp)
    if origin is Literal:
        if value in get_args(tp):
            return value
        raise fail(field, value, _describe(tp))
    if origin in (typing.Union, types.UnionType):
        return _coerce_union(tp, value, field)
    if origin is tuple:
        return _coerce_tuple(tp, value, field)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise fail(field, value, _describe(tp))
        return build(tp, value, field)
    scalar = _SCALARS.get(tp)
    if scalar is not None:
        return scalar(value, field)
    if tp is Any:
        return value
    raise TypeError(f"{field}: unsupported annotation {tp!r}")


def _coerce_union(tp: Any, value: Any, field: str) -> Any:
    if value is None and type(None) in get_args(tp):
        return None
    for option in get_args(tp):
        if option is type(None):
            continue
        try:
            return coerce(option, value, field)
        except ConfigError:
            pass
    raise fail(field, value, _describe(tp))


def _coerce_tuple(tp: Any, value: Any, field: str) -> tuple[Any, ...]:
    (item_tp, *_rest) = get_args(tp)
    if isinstance(value, str):
        value = [v for v in value.split(",") if v.strip()]
    if not isinstance(value, (list, tuple)):
        raise fail(field, value, _describe(tp))
    return tuple(coerce(item_tp, v, f"{field}[{i}]") for i, v in enumerate(value))


def _coerce_bool(value: Any, field: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
        return value.lower() in ("true", "1", "yes")
    raise fail(field, value, "true | false")


def _coerce_int(value: Any, field: str) -> int:
    if isinstance(value, bool):
        raise fail(field, value, "an integer")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value.replace("_", ""), 0)
        except ValueError:
            pass
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise fail(field, value, "an integer")


def _coerce_float(value: Any, field: str) -> float:
    number = _as_float(value)
    if number is None:
        raise fail(field, value, "a number")
    if not math.isfinite(number):  # nan and inf parse as floats, and then train nothing
        raise fail(field, value, "a finite number")
    return number


def _coerce_str(value: Any, field: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise fail(field, value, "a string")


_SCALARS = {bool: _coerce_bool, int: _coerce_int, float: _coerce_float, str: _coerce_str}


def _as_float(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def build(cls: type[T], data: Mapping[str, Any], prefix: str = "") -> T:
    """Instantiate dataclass ``cls`` from ``data``, rejecting unknown keys and wrong types."""
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"{prefix}.{unknown[0]}" if prefix else unknown[0]
        raise ConfigError(
            f"{where}: unknown key (allowed keys{' in ' + prefix if prefix else ''}: {', '.join(fields)})"
        )
    kwargs = {}
    for name, f in fields.items():
        dotted = f"{prefix}.{name}" if prefix else name
        if name in data:
            kwargs[name] = coerce(hints[name], data[name], dotted)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{dotted}: required key is missing (expected {_describe(hints[name])})")
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        if prefix and not str(exc).startswith(prefix):
            raise ConfigError(f"{prefix}.{exc}") from None
        raise


def to_dict(obj: Any) -> Any:
    """Plain-data view of a (nested) dataclass, tuples as lists: the inverse of ``build``."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
    if isinstance(obj, tuple):
        return [to_dict(v) for v in obj]
    return obj


def parse_override(text: str) -> tuple[list[str], str]:
    """``"parallel.pp=8"`` -> (["parallel", "pp"], "8")."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected KEY=VALUE with a dotted key, e.g. parallel.pp=8")
    key, value = text.split("=", 1)
    path = [p for p in key.strip().split(".") if p]
    if not path:
        raise ConfigError(f"--set {text!r}: empty key")
    return path, value.strip()


def apply_overrides(data: dict[str, Any], overrides: list[str], root_cls: type) -> dict[str, Any]:
    """Apply ``a.b=value`` overrides to nested plain data, checking each key exists in the schema."""
    data = _deepcopy(data)
    for text in overrides:
        path, raw = parse_override(text)
        cls: Any = root_cls
        node = data
        for depth, part in enumerate(path):
            dotted = ".".join(path[: depth + 1])
            hints = get_type_hints(cls) if dataclasses.is_dataclass(cls) else {}
            if part not in hints:
                allowed = ", ".join(hints) if hints else "(no sub-keys)"
                raise ConfigError(f"--set {dotted}: unknown key (allowed: {allowed})")
            field_tp = hints[part]
            last = depth == len(path) - 1
            if last:
                node[part] = _parse_scalar(raw)
            else:
                field_tp = _strip_optional(field_tp)
                if not dataclasses.is_dataclass(field_tp) or not isinstance(node.setdefault(part, {}), dict):
                    raise ConfigError(f"--set {'.'.join(path)}: {dotted} is a value, not a section")
                node = node[part]
                cls = field_tp
    return data


def _strip_optional(tp: Any) -> Any:
    if get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _parse_scalar(raw: str) -> Any:
    """CLI values arrive as text; YAML's scalar rules give ints, floats, bools and null."""
    import yaml

    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw
    return raw if isinstance(value, (dict, list)) and "," not in raw else value


def _deepcopy(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _deepcopy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deepcopy(v) for v in data]
    return data
