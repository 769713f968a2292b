"""NCCL's matching rules, enforced over gloo: ``MEGATRON_SLIM_NCCL_RULES=1``.

A run on gloo can pass where the same run on NCCL hangs or trains on the wrong tensors: gloo
matches point-to-point messages by tag and buffers sends, NCCL ignores tags, matches the messages
between two ranks in posting order and runs them in issue order. With this switch set, every rank
replaces torch.distributed's point-to-point functions and collectives with checked ones
(``p2p.py``, ``collectives.py``) before its first message, and an operation NCCL would treat
differently fails at once with :class:`NcclRuleBroken`, naming the call sites on both ends:

- a receive matched (by posting order) with a send of another tag, size or dtype;
- a pair of ranks that post the two directions between them in crossed orders, outside one
  ``batch_isend_irecv``: each sends before receiving the other's message (a deadlock on NCCL once
  messages outgrow its buffers), or each receives before sending (always a deadlock);
- a receive from any source (NCCL has none);
- members of a communicator issuing different collectives, or different sizes, at one position.

Not modelled: the ordering NCCL's streams impose between a communicator's collectives and its
point-to-point messages (PyTorch runs unbatched point-to-point messages on communicators of their
own, and how it runs batched ones depends on its version). It is a test tool: it sends a header or
a descriptor beside every message and collective, and is meant for gloo runs only.
"""

from __future__ import annotations

import os
import threading

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from megatron_slim.runtime.nccl_rules.collectives import CHECKED, Collectives
from megatron_slim.runtime.nccl_rules.p2p import PointToPoint
from megatron_slim.runtime.nccl_rules.wire import NcclRuleBroken

ENV = "MEGATRON_SLIM_NCCL_RULES"
_P2P = ("isend", "irecv", "send", "recv", "batch_isend_irecv")
_lock = threading.Lock()
_installed: list[PointToPoint] = []

__all__ = ["ENV", "NcclRuleBroken", "active", "install", "install_if_asked", "tags_keep_messages_apart"]


def active() -> bool:
    return bool(_installed)


def asked() -> bool:
    return os.environ.get(ENV, "") == "1"


def install_if_asked() -> bool:
    """Install the checker when ``MEGATRON_SLIM_NCCL_RULES=1``; True if it is installed."""
    if asked():
        install()
    return active()


def install() -> None:
    """Replace torch.distributed's point-to-point functions and collectives in this process (once)."""
    with _lock:
        if _installed:
            return
        original = {name: getattr(c10d, name) for name in (*_P2P, *CHECKED)}
        p2p, collectives = PointToPoint(original), Collectives(original)
        checked = {name: getattr(p2p, name) for name in _P2P}
        for name, method in list(checked.items()):
            checked[name] = _named(method, name)
        checked.update({name: collectives.wrap(name) for name in CHECKED})
        for name, function in checked.items():
            setattr(c10d, name, function)
            setattr(dist, name, function)
        _installed.append(p2p)


def tags_keep_messages_apart(group) -> bool:
    """True where point-to-point tags keep two message streams between the same ranks apart: gloo,
    unless this checker makes it behave as NCCL (which ignores tags)."""
    return str(dist.get_backend(group)) == "gloo" and not active()


def _named(method, name: str):
    """``method`` as a plain function called ``name`` (``P2POp`` accepts ``isend``/``irecv`` by identity
    with the module's functions, and ``batch_isend_irecv`` tells a send from a receive by name)."""

    def function(*args, **kwargs):
        return method(*args, **kwargs)

    function.__name__ = function.__qualname__ = name
    return function
