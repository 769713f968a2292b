"""Point-to-point messages matched as NCCL matches them, over gloo.

NCCL matches the messages between two ranks of a communicator in posting order and ignores tags;
gloo matches by tag. So every checked message travels on one gloo tag per direction, behind a
header from the sender (its own tag, element count, dtype, shape, call site): gloo then pairs a
receive with the sender's next message exactly as NCCL would, and the receive compares what it
expected with what the header says came, failing with both call sites when they differ.

NCCL runs the operations between two ranks in issue order on one stream, and a send of more than
its buffers hold waits for the peer's receive to run. So when rank A posts a send to B before a
receive from B, while B posts the send that receive matches before its receive of A's message,
each waits for the other: a deadlock gloo never shows (its sends are buffered). The header carries
how many receives from the receiver the sender had posted by then, and the receive compares it
with how many sends it had posted to the sender before itself; operations of one
``batch_isend_irecv`` run as one group and never wait for each other.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megatron_slim.runtime.nccl_rules.matching import check_match
from megatron_slim.runtime.nccl_rules.wire import (
    NcclRuleBroken,
    call_site,
    decode,
    empty,
    encode,
    global_rank,
    group_name,
)

HEADER_TAG = 2**31 - 3
PAYLOAD_TAG = 2**31 - 2
_SITES_KEPT = 4096  # call sites of recent sends per channel, to name them in a deadlock report


@dataclass
class _Channel:
    """This rank's history with one peer on one communicator."""

    sent: int = 0
    received: int = 0
    send_sites: deque = field(default_factory=lambda: deque(maxlen=_SITES_KEPT))


class Together:
    """Works that complete together, waited on once (a gloo point-to-point work waited on twice
    waits for a second message): a send's header and payload, or one ``batch_isend_irecv``'s
    operations, which NCCL runs as one group, so that waiting on one waits on all."""

    def __init__(self, works: list) -> None:
        self._works, self._done = works, False

    def wait(self, timeout: Any = None) -> bool:
        if not self._done:
            for work in self._works:
                work.wait()
            self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done or all(work.is_completed() for work in self._works)


class _Received:
    """A receive: ready once its channel's receiver has checked the header and posted the payload's receive."""

    def __init__(self, header_work, header: torch.Tensor, tensor: torch.Tensor, expected: dict) -> None:
        self.header_work, self.header, self.tensor, self.expected = header_work, header, tensor, expected
        self.ready = threading.Event()
        self.error: Optional[BaseException] = None
        self.payload_work: Any = None
        self._done = False

    def wait(self, timeout: Any = None) -> bool:
        self.ready.wait()
        if self.error is not None:
            raise self.error
        if not self._done:
            self.payload_work.wait()
            self._done = True
        return True

    def is_completed(self) -> bool:
        if not self.ready.is_set():
            return False
        if self.error is not None:
            raise self.error
        return self._done or bool(self.payload_work.is_completed())


class _Receiver:
    """One thread per channel takes its headers in order and posts each payload's receive once the
    header is checked: into the caller's tensor, or, when the header disagrees, into a scratch buffer
    of the size sent (gloo aborts the whole process on a receive of the wrong size)."""

    def __init__(self, irecv: Callable, peer: int, group: Any, check: Callable) -> None:
        self._irecv, self._peer, self._group, self._check = irecv, peer, group, check
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name=f"nccl-rules-recv-{peer}", daemon=True).start()

    def post(self, received: _Received) -> None:
        self._queue.put(received)

    def _serve(self) -> None:
        broken: Optional[BaseException] = None  # once a receive took the wrong message, every later one did
        while True:
            received = self._queue.get()
            if broken is not None:  # fail its wait at once, then take its message off the wire all the same
                received.error = NcclRuleBroken(f"an earlier receive on this channel was matched wrongly: {broken}")
                received.ready.set()
                self._drain(received)
                continue
            try:
                received.header_work.wait()
                header = decode(received.header)
                target = received.tensor
                try:
                    self._check(header, received.expected)
                except NcclRuleBroken as exc:
                    received.error = broken = exc
                    target = _scratch(header)
                received.payload_work = self._irecv(target, self._peer, self._group, PAYLOAD_TAG)
            except BaseException as exc:  # noqa: BLE001 - e.g. the peer died: raised by the receive's wait
                received.error = received.error or exc
            finally:
                received.ready.set()

    def _drain(self, received: _Received) -> None:
        """Receive the next message into a scratch buffer of its sent size, so that its sender completes."""
        try:
            received.header_work.wait()
            header = decode(received.header)
            self._irecv(_scratch(header), self._peer, self._group, PAYLOAD_TAG).wait()
        except BaseException:  # noqa: BLE001 - the channel is already reported broken
            pass


class PointToPoint:
    """Checked ``isend``/``irecv``/``send``/``recv``/``batch_isend_irecv`` over the original functions."""

    def __init__(self, original: dict[str, Callable]) -> None:
        self._original = original
        self._lock = threading.Lock()
        self._channels: dict[tuple[str, int], _Channel] = {}
        self._receivers: dict[tuple[str, int], _Receiver] = {}
        self._batch = threading.local()

    def isend(self, tensor, dst=None, group=None, tag=0, group_dst=None, *, _site: Optional[str] = None):
        if _outside(group):
            return self._original["isend"](tensor, dst, group, tag, group_dst=group_dst)
        peer = global_rank(group, group_dst, dst)
        key = (group_name(group), peer)
        site = _site or call_site()
        with self._lock:
            channel = self._channels.setdefault(key, _Channel())
            received = self._span(key, channel)[2:]  # receives from the peer posted before it, and by its batch's end
            header = encode(
                {
                    **_message(tensor, tag, site),
                    "seq": channel.sent,
                    "rank": dist.get_rank(),
                    "received": list(received),
                }
            )
            channel.send_sites.append((channel.sent, site))
            channel.sent += 1
            works = [
                self._original["isend"](t, peer, group, wire_tag)
                for t, wire_tag in ((header, HEADER_TAG), (tensor, PAYLOAD_TAG))
            ]
        return Together(works)

    def irecv(self, tensor, src=None, group=None, tag=0, group_src=None, *, _site: Optional[str] = None):
        if _outside(group):
            return self._original["irecv"](tensor, src, group, tag, group_src=group_src)
        peer = global_rank(group, group_src, src)
        key = (group_name(group), peer)
        site = _site or call_site()
        with self._lock:
            channel = self._channels.setdefault(key, _Channel())
            sent = self._span(key, channel)[:2]  # sends to the peer posted before it, and by its batch's end
            expected = {
                **_message(tensor, tag, site),
                "seq": channel.received,
                "peer": peer,
                "group": key[0],
                "sent": list(sent),
            }
            channel.received += 1
            header = empty()
            received = _Received(self._original["irecv"](header, peer, group, HEADER_TAG), header, tensor, expected)
            if key not in self._receivers:
                self._receivers[key] = _Receiver(self._original["irecv"], peer, group, self._check)
            self._receivers[key].post(received)
        return received

    def send(self, tensor, dst=None, group=None, tag=0, group_dst=None) -> None:
        work = self.isend(tensor, dst, group, tag, group_dst, _site=call_site())
        if work is not None:
            work.wait()

    def recv(self, tensor, src=None, group=None, tag=0, group_src=None) -> int:
        site = call_site()
        if src is None and group_src is None:
            raise NcclRuleBroken(f"{site}: a receive from any source (src=None): NCCL has none; name the sender")
        work = self.irecv(tensor, src, group, tag, group_src, _site=site)
        if work is not None:
            work.wait()
        return global_rank(group, group_src, src)

    def batch_isend_irecv(self, ops: list) -> list:
        """Each op posted as a checked ``isend``/``irecv``; their works complete together (``Batch``)."""
        if not ops:
            return []
        site = call_site()
        with self._lock:
            starts: dict[tuple[str, int], tuple[int, int, int, int]] = {}
            for op in ops:
                key = (group_name(op.group), int(op.peer))
                channel = self._channels.setdefault(key, _Channel())
                sent0, sent1, received0, received1 = starts.get(
                    key, (channel.sent, channel.sent, channel.received, channel.received)
                )
                starts[key] = (sent0, sent1 + _is_send(op), received0, received1 + (not _is_send(op)))
        self._batch.starts = starts
        try:
            works = [
                (self.isend if _is_send(op) else self.irecv)(op.tensor, op.peer, op.group, op.tag, _site=site)
                for op in ops
            ]
        finally:
            self._batch.starts = None
        batch = Together([w for w in works if w is not None])
        return [batch for _ in works]

    def _in_batch(self) -> bool:
        return getattr(self._batch, "starts", None) is not None

    def _span(self, key: tuple[str, int], channel: _Channel) -> tuple[int, int, int, int]:
        """Sends to the peer posted before this operation (before its batch, if in one) and by its
        batch's end; the same for receives from the peer (a batch's operations are unordered)."""
        if self._in_batch():
            return self._batch.starts[key]
        return channel.sent, channel.sent, channel.received, channel.received

    def _check(self, header: dict, expected: dict) -> None:
        check_match(header, expected, self._send_site)

    def _send_site(self, key: tuple[str, int], seq: int) -> str:
        with self._lock:
            sites = dict(self._channels[key].send_sites)
        return sites.get(seq, "<a send too long ago to name>")


def _message(tensor: torch.Tensor, tag: int, site: str) -> dict:
    """What both ends say of a message: the receive's expectation is compared with the sender's header."""
    return {
        "tag": int(tag),
        "numel": tensor.numel(),
        "dtype": str(tensor.dtype),
        "shape": list(tensor.shape),
        "site": site,
    }


def _scratch(header: dict) -> torch.Tensor:
    return torch.empty(int(header["numel"]), dtype=getattr(torch, str(header["dtype"]).split(".")[-1]))


def _is_send(op: Any) -> bool:
    return getattr(op.op, "__name__", "") == "isend"


def _outside(group: Any) -> bool:
    return dist.distributed_c10d._rank_not_in_group(group)
