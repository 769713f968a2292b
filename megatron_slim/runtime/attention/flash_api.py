"""Calls into flash-attn 2 (``flash_attn``) and flash-attn 3 (``flash_attn_interface``).

We need the kernels' separate forward/backward with the log-sum-exp, which flash-attn only
exposes through its private ``_flash_attn_*`` functions. Their parameter lists change
between releases (``window_size`` became ``window_size_left/right``, ``softcap`` and
``block_table`` appeared, FA3 renamed ``causal`` to ``is_causal`` in backward), so every call
passes keyword arguments filtered by the installed function's own signature. Return tuples
also changed; ``_out_and_lse`` picks the two tensors we need by position and shape.

UNEXERCISED where no GPU and flash-attn are present; tests marked ``gpu`` cover it.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Any, Callable

import torch

Tensor = torch.Tensor

MIN_FA2_VERSION = (2, 6)  # first release whose varlen lse is packed [hq, total_q]
_TOP_MODULES = ("flash_attn", "flash_attn_interface", "flash_attn.flash_attn_interface")
_NO_WINDOW = {"window_size": (-1, -1), "window_size_left": -1, "window_size_right": -1}
# What every call fixes: no dropout, softcap, ALiBi or sliding window; backward has no RNG state
# to replay and may use the faster non-deterministic dq accumulation.
_NO_EXTRAS = {"dropout_p": 0.0, "softcap": 0.0, "alibi_slopes": None, **_NO_WINDOW}
_FORWARD_FIXED = {**_NO_EXTRAS, "return_softmax": False}
_BACKWARD_FIXED = {**_NO_EXTRAS, "deterministic": False, "rng_state": None}


def _parameters(fn: Callable) -> set[str]:
    # torch.library.custom_op wraps the Python function; its signature is (*args, **kwargs).
    target = getattr(fn, "_init_fn", fn)
    return set(inspect.signature(target).parameters)


def _call(fn: Callable, **kwargs: Any):
    accepted = _parameters(fn)
    return fn(**{name: value for name, value in kwargs.items() if name in accepted})


def _out_and_lse(res: Any, lse_shape: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    """out is always first; lse is the first later fp32 tensor whose shape starts with lse_shape."""
    out = res[0]
    for t in res[1:]:
        if isinstance(t, Tensor) and t.dtype == torch.float32 and tuple(t.shape[: len(lse_shape)]) == lse_shape:
            return out, t[tuple(slice(0, n) for n in lse_shape)]
    raise RuntimeError(f"flash-attn returned no lse of shape {lse_shape}; unsupported flash-attn version")


def _version(module_name: str) -> tuple[int, ...]:
    mod = importlib.import_module(module_name)
    parts = []
    for piece in str(getattr(mod, "__version__", "0")).split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


class FlashApi:
    """One flash-attn generation: dense and varlen forward/backward on prepared tensors."""

    def __init__(self, label: str, fwd, bwd, varlen_fwd, varlen_bwd):
        self.label = label
        self._fwd, self._bwd, self._varlen_fwd, self._varlen_bwd = fwd, bwd, varlen_fwd, varlen_bwd

    def forward(self, q, k, v, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        res = _call(self._fwd, q=q, k=k, v=v, softmax_scale=scale, causal=causal, **_FORWARD_FIXED)
        return _out_and_lse(res, (q.shape[0], q.shape[2], q.shape[1]))

    def backward(self, dout, q, k, v, out, lse, causal: bool, scale: float):
        return _backward(self._bwd, dout, q, k, v, out, lse, causal, scale)

    def varlen_forward(self, q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float):
        lengths = _varlen_lengths(cu_q, cu_k, max_q, max_k)
        res = _call(
            self._varlen_fwd,
            q=q,
            k=k,
            v=v,
            softmax_scale=scale,
            causal=causal,
            block_table=None,
            **lengths,
            **_FORWARD_FIXED,
        )
        return _out_and_lse(res, (q.shape[1], q.shape[0]))

    def varlen_backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
        lengths = _varlen_lengths(cu_q, cu_k, max_q, max_k)
        return _backward(self._varlen_bwd, dout, q, k, v, out, lse, causal, scale, **lengths)


def _varlen_lengths(cu_q, cu_k, max_q: int, max_k: int) -> dict[str, Any]:
    return {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "max_seqlen_q": max_q, "max_seqlen_k": max_k}


def _backward(fn: Callable, dout, q, k, v, out, lse, causal: bool, scale: float, **lengths: Any):
    """Gradients into fresh buffers; ``causal`` is sent under both names (FA3 backward says is_causal)."""
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _call(
        fn,
        dout=dout,
        q=q,
        k=k,
        v=v,
        out=out,
        softmax_lse=lse,
        dq=dq,
        dk=dk,
        dv=dv,
        softmax_scale=scale,
        causal=causal,
        is_causal=causal,
        **lengths,
        **_BACKWARD_FIXED,
    )
    return dq, dk, dv


def _load_fa3() -> FlashApi:
    # FA3 (hopper/) installs the top-level module flash_attn_interface; one function serves
    # dense and varlen (cu_seqlens=None for dense).
    mod = importlib.import_module("flash_attn_interface")
    return FlashApi(
        "flash-attn 3",
        mod._flash_attn_forward,
        mod._flash_attn_backward,
        mod._flash_attn_forward,
        mod._flash_attn_backward,
    )


def _load_fa2() -> FlashApi:
    version = _version("flash_attn")
    if version < MIN_FA2_VERSION:
        raise ImportError(f"flash-attn {'.'.join(map(str, version))} < 2.6 is not supported")
    mod = importlib.import_module("flash_attn.flash_attn_interface")
    return FlashApi(
        f"flash-attn {'.'.join(map(str, version))}",
        mod._flash_attn_forward,
        mod._flash_attn_backward,
        mod._flash_attn_varlen_forward,
        mod._flash_attn_varlen_backward,
    )


@functools.cache
def load(prefer_fa3: bool) -> tuple[FlashApi | None, str]:
    """(api, why): FA3 first when ``prefer_fa3`` (Hopper), else FA2; api None if neither loads."""
    reasons = []
    loaders = [("flash-attn 3", _load_fa3)] if prefer_fa3 else []
    loaders.append(("flash-attn 2", _load_fa2))
    for label, loader in loaders:
        try:
            api = loader()
        except ImportError as exc:  # also a missing CUDA library or a too-old version
            missing = isinstance(exc, ModuleNotFoundError) and exc.name in _TOP_MODULES
            reasons.append(f"{label} not installed" if missing else f"{label}: {exc}")
            continue
        except Exception as exc:  # a broken install must not break backend selection
            reasons.append(f"{label} failed to import: {exc}")
            continue
        return api, api.label
    return None, "; ".join(reasons)
