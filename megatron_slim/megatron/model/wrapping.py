"""Wrapping megatron-core modules in place: strip DDP-style wrappers, wrap a rotary embedding."""

from __future__ import annotations

from typing import Any

import torch


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """Strip DDP / Float16Module style wrappers (``.module`` chains)."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


class RotaryWrapper(torch.nn.Module):
    """Base of the rotary wrappers that choose positions (slice offsets, CP plans): holds the
    chunk's own rotary module and passes every other attribute (``get_rotary_seq_len`` ...) to it."""

    def __init__(self, inner: torch.nn.Module, context: Any) -> None:
        super().__init__()
        self.inner = inner
        self.context = context

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("inner"), name)


def wrap_rotary(chunk: torch.nn.Module, wrapper: type[Any], context: Any) -> None:
    """Give ``chunk``'s rotary embedding a ``wrapper`` (a RotaryWrapper subclass) reading
    ``context``; a chunk wrapped before is only pointed at the new context."""
    inner = unwrap(chunk)
    rotary = getattr(inner, "rotary_pos_emb", None)
    if rotary is None:
        return
    if isinstance(rotary, wrapper):
        rotary.context = context
    else:
        inner.rotary_pos_emb = wrapper(rotary, context)
