"""Collectives checked as NCCL needs them: every member issues the same ones, in the same order.

NCCL matches collectives on a communicator by issue order alone: when two members issue different
ones (or the same one with different sizes) at the same position, it hangs or mixes data. Before
each collective the checker gathers, over the same communicator, a descriptor from every member
(operation, position, dtype, the sizes that must agree, call site) and fails, naming every
member's call site, when they disagree. The gather is posted asynchronously like the collective
itself, so it adds no wait NCCL would not have; the check runs when the collective's work is
waited on. Collectives called from inside another (the ``*_object`` helpers) are checked once.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch
import torch.distributed as dist

from megatron_slim.runtime.nccl_rules.wire import NcclRuleBroken, call_site, decode, empty, encode, group_name

# collective -> (position of its group argument, how to read the sizes every member must agree on)
_POSITIONAL_GROUP = {
    "all_reduce": 2,
    "broadcast": 2,
    "reduce": 3,
    "all_gather": 2,
    "all_gather_into_tensor": 2,
    "reduce_scatter_tensor": 3,
    "reduce_scatter": 3,
    "all_to_all_single": 4,
    "all_to_all": 2,
    "barrier": 0,
    "gather": 3,
    "scatter": 3,
    "all_gather_object": 2,
    "broadcast_object_list": 2,
    "gather_object": 3,
    "scatter_object_list": 3,
}
CHECKED = tuple(_POSITIONAL_GROUP)


def agreed_sizes(name: str, args: tuple, kwargs: dict) -> list:
    """What every member's call must share beyond its name: dtypes, element counts, root, reduce op."""

    def arg(i: int, key: str, default: Any = None) -> Any:
        return args[i] if len(args) > i else kwargs.get(key, default)

    def shape(t: Any) -> list:
        return [str(t.dtype), t.numel()] if isinstance(t, torch.Tensor) else []

    if name in ("all_reduce", "broadcast", "reduce"):
        root = arg(1, "src", arg(1, "dst")) if name != "all_reduce" else None
        op = arg(1, "op") if name == "all_reduce" else arg(2, "op") if name == "reduce" else None
        return [*shape(arg(0, "tensor")), None if root is None else int(root), str(op)]
    if name in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        return [
            *shape(arg(0, "output_tensor" if name == "all_gather_into_tensor" else "output")),
            *shape(arg(1, "input_tensor" if name == "all_gather_into_tensor" else "input")),
        ]
    if name == "all_gather":
        tensors = arg(0, "tensor_list") or []
        return [*shape(arg(1, "tensor")), len(tensors)]
    if name == "reduce_scatter":
        return [*shape(arg(0, "output")), len(arg(1, "input_list") or [])]
    if name == "all_to_all_single":
        out, inp = arg(0, "output"), arg(1, "input")
        return [str(inp.dtype), list(inp.shape[1:]), str(out.dtype)]
    if name == "all_to_all":
        return [len(arg(0, "output_tensor_list") or [])]
    if name in ("gather", "scatter"):
        return [*shape(arg(0, "tensor")), arg(2, "dst" if name == "gather" else "src")]
    return []


def split_sizes(name: str, args: tuple, kwargs: dict) -> list:
    """``all_to_all_single``'s rows sent to and received from each member (checked crosswise)."""
    if name != "all_to_all_single":
        return []
    out = args[0] if args else kwargs["output"]
    inp = args[1] if len(args) > 1 else kwargs["input"]
    outs = args[2] if len(args) > 2 else kwargs.get("output_split_sizes")
    ins = args[3] if len(args) > 3 else kwargs.get("input_split_sizes")
    return [list(ins) if ins else [int(inp.shape[0])], list(outs) if outs else [int(out.shape[0])]]


class _Checked:
    """The collective's work, waited on only after every member's descriptor agreed."""

    def __init__(self, verify: Callable[[], None], work: Any) -> None:
        self._verify, self._work = verify, work

    def wait(self, timeout: Any = None) -> bool:
        self._verify()
        if self._work is not None:
            self._work.wait()
        return True

    def is_completed(self) -> bool:
        return self._work is None or bool(self._work.is_completed())

    def get_future(self) -> Any:
        return self._work.get_future()


class Collectives:
    def __init__(self, original: dict[str, Callable]) -> None:
        self._original = original
        self._lock = threading.Lock()
        self._issued: dict[str, int] = {}
        self._inside = threading.local()

    def wrap(self, name: str) -> Callable:
        original = self._original[name]

        def checked(*args, **kwargs):
            at = _POSITIONAL_GROUP[name]
            group = args[at] if len(args) > at else kwargs.get("group")
            if getattr(self._inside, "depth", 0) or dist.distributed_c10d._rank_not_in_group(group):
                return original(*args, **kwargs)
            self._inside.depth = 1  # the descriptor's gather, and whatever a torch-function mode makes of it
            try:
                verify = self._announce(name, group, args, kwargs)
            finally:
                self._inside.depth = 0
            asked_async = bool(kwargs.pop("async_op", False))
            if not asked_async:  # checked before it is issued: gloo aborts the process on some mismatches
                verify()
            self._inside.depth = 1
            try:
                work = original(*args, **kwargs, **({"async_op": True} if name not in _NO_ASYNC else {}))
            finally:
                self._inside.depth = 0
            checked_work = _Checked(verify, work if name not in _NO_ASYNC else None)
            if asked_async:
                return checked_work
            checked_work.wait()
            return None

        checked.__name__ = checked.__qualname__ = name
        checked.__wrapped__ = original  # type: ignore[attr-defined]
        return checked

    def _announce(self, name: str, group: Any, args: tuple, kwargs: dict) -> Callable[[], None]:
        """Post the gather of every member's descriptor for this collective; return its check."""
        comm = group_name(group)
        with self._lock:
            position = self._issued.get(comm, 0)
            self._issued[comm] = position + 1
            record = {
                "op": name,
                "pos": position,
                "agree": agreed_sizes(name, args, kwargs),
                "splits": split_sizes(name, args, kwargs),
                "site": call_site(),
                "rank": dist.get_rank(),
            }
            size = dist.get_world_size(group)
            gathered = [empty() for _ in range(size)]
            work = self._original["all_gather"](gathered, encode(record), group=group, async_op=True)
        done: list[bool] = []

        def verify() -> None:
            if not done:
                work.wait()
                done.append(True)
                check_agreement(comm, [decode(t) for t in gathered])

        return verify


# object collectives run their tensor collectives synchronously inside and return no work
_NO_ASYNC = frozenset({"all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list"})


def check_agreement(comm: str, records: list[dict]) -> None:
    """Raise :class:`NcclRuleBroken` unless every member issued the same collective with agreeing sizes."""
    first = records[0]
    if any((r["op"], r["pos"], r["agree"]) != (first["op"], first["pos"], first["agree"]) for r in records):
        listing = "; ".join(f"rank {r['rank']}: {r['op']} #{r['pos']} {r['agree']} at {r['site']}" for r in records)
        raise NcclRuleBroken(
            f"communicator {comm}: NCCL matches collectives by issue order, and its members issued different ones "
            f"(or with different sizes) at the same position: {listing}"
        )
    if first["op"] == "all_to_all_single" and all(len(r["splits"][0]) == len(records) for r in records):
        for i, sender in enumerate(records):
            for j, receiver in enumerate(records):
                sent, expected = sender["splits"][0][j], receiver["splits"][1]
                if len(expected) == len(records) and sent != expected[i]:
                    raise NcclRuleBroken(
                        f"communicator {comm}: all_to_all_single #{first['pos']}: member {i} sends {sent} rows to "
                        f"member {j} ({sender['site']}), which expects {expected[i]} ({receiver['site']})"
                    )
