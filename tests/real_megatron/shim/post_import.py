"""Run a callback on a module right after it is first imported (test harness only)."""

from __future__ import annotations

import importlib.abc
import sys
from typing import Callable

_callbacks: dict[str, list[Callable]] = {}


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _callbacks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader, _callbacks.pop(fullname))
                return spec
        return None


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, callbacks):
        self.inner, self.callbacks = inner, callbacks

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        for callback in self.callbacks:
            callback(module)


def when_imported(name: str, callback: Callable) -> None:
    if name in sys.modules:
        callback(sys.modules[name])
        return
    _callbacks.setdefault(name, []).append(callback)
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
