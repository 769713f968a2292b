"""The one place that chooses an attention backend.

Order when nothing is forced: flash > te > sdpa > reference, taking the first that is
installed and supports the device (and dtype, when given). A name can be forced by the
``preferred`` argument or, when that is None, by the environment variable
``MEGATRON_SLIM_ATTENTION_BACKEND``; a forced backend that cannot run raises ValueError
listing the ones that can. The choice and its reason are logged once at INFO on the
``megatron_slim`` logger; ``choose_backend`` returns them for a CLI to print.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os

import torch

from megatron_slim.runtime.attention.backend import AttentionBackend
from megatron_slim.runtime.attention.flash import load_flash_backend
from megatron_slim.runtime.attention.reference import ReferenceBackend
from megatron_slim.runtime.attention.sdpa import SdpaBackend
from megatron_slim.runtime.attention.te import load_te_backend

ENV_VAR = "MEGATRON_SLIM_ATTENTION_BACKEND"
BACKEND_NAMES = ("flash", "te", "sdpa", "reference")

_log = logging.getLogger("megatron_slim")
_logged_messages: set[str] = set()


@dataclasses.dataclass(frozen=True)
class BackendChoice:
    name: str
    reason: str
    backend: AttentionBackend

    def describe(self) -> str:
        return f"attention backend: {self.name} ({self.reason})"

    @property
    def label(self) -> str:
        """``name (reason)``, or the name alone when there is no reason."""
        return f"{self.name} ({self.reason})" if self.reason else self.name


def _load(name: str, device: torch.device) -> tuple[AttentionBackend | None, str]:
    if name == "flash":
        return load_flash_backend(device)
    if name == "te":
        return load_te_backend(device)
    if name == "sdpa":
        return SdpaBackend(), f"torch {torch.__version__} fused SDPA"
    return ReferenceBackend(), "plain torch math"


def _candidate(name: str, device: torch.device, dtype: torch.dtype | None) -> tuple[AttentionBackend | None, str]:
    backend, why = _load(name, device)
    if backend is None:
        return None, why
    unsupported = backend.unsupported_reason(device, dtype)
    if unsupported is not None:
        return None, f"{name}: {unsupported}"
    return backend, why


def _resolve_device(device: torch.device | str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


@functools.lru_cache(maxsize=64)
def _choose(preferred: str | None, source: str, device: torch.device, dtype: torch.dtype | None) -> BackendChoice:
    if preferred is not None:
        name = preferred.strip().lower()
        if name not in BACKEND_NAMES:
            raise ValueError(f"attention backend {preferred!r} ({source}) is unknown: choose one of {BACKEND_NAMES}")
        backend, why = _candidate(name, device, dtype)
        if backend is None:
            available = [n for n in BACKEND_NAMES if _candidate(n, device, dtype)[0] is not None]
            on = f"{device}" + (f", {dtype}" if dtype is not None else "")
            raise ValueError(
                f"attention backend {name!r} ({source}) is unavailable on {on}: {why}; available: {available}"
            )
        return BackendChoice(name, f"{source}; {why}", backend)
    skipped: list[str] = []
    for name in BACKEND_NAMES:
        backend, why = _candidate(name, device, dtype)
        if backend is not None:
            return BackendChoice(name, "; ".join(skipped) if skipped else why, backend)
        skipped.append(why)
    raise AssertionError("the reference backend runs everywhere")  # unreachable


def choose_backend(
    preferred: str | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> BackendChoice:
    """The backend, its name and why it was chosen; see the module docstring for the rules."""
    source = "requested"
    if preferred is None:
        preferred = os.environ.get(ENV_VAR, "").strip() or None
        source = f"forced by {ENV_VAR}"
    return _choose(preferred, source, _resolve_device(device), dtype)


def select_backend(
    preferred: str | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> AttentionBackend:
    """``choose_backend(...).backend``, logging the choice once per distinct outcome."""
    choice = choose_backend(preferred, device, dtype)
    message = choice.describe()
    if message not in _logged_messages:
        _logged_messages.add(message)
        _log.info(message)
    return choice.backend
