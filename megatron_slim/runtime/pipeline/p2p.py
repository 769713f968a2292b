"""Point-to-point transfers between pipeline ranks for the interpreter's SEND/RECV actions.

Every message is tagged with (direction, stage, microbatch, slice) so gloo matches it exactly;
for NCCL, which ignores tags, the planner guarantees each directed link carries its messages in
the same order on both ends (``plan.schedule.validate.check_link_order``).

The sends and receives a rank posts between two compute actions (one communication point) go out
as one ``batch_isend_irecv`` (``flush``, called before each compute and before any wait): NCCL
runs the operations between two ranks in posting order and a large send waits for its receive, so
two ranks that each posted a receive (or a send) to the other ahead of the matching other one
would wait for each other; in one batch, NCCL runs them as one group. The runtime's NCCL checker
(``runtime/nccl_rules``) holds every pipeline test to this.

A send's handle keeps its tensor, and so the slice's storage, alive: Megatron's
``deallocate_output_tensor`` frees nothing while it is held. Handles are dropped as soon as their
transfer is seen complete (``poll``), and a link keeps at most ``SEND_WINDOW`` sends outstanding:
a send that the plan bounds (``plan.schedule.walk.bounded_sends``) first waits for the oldest ones.
Sends complete in posting order on a link, so only the oldest are ever checked.

Receives are posted ahead (``post``) where ``plan.schedule.recv_posts`` places them: in the point
that is current when the sender issues the message, so that the two ranks of a pair agree on the
order of the messages between them (``plan.schedule.pair_order`` checks it for every schedule in
the plan tests); ``recv`` waits for a posted receive or, for one the plan posts in place, posts
and waits at once.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_slim.plan.schedule.walk import SEND_WINDOW
from megatron_slim.runtime.pipeline.memory_meter import InFlightBytes


@dataclass
class _Sent:
    work: Optional[dist.Work]  # None until its point's batch is issued (``flush``)
    key: tuple[str, int, int]  # ("send", dst, tag)


def _completed(work: Optional[dist.Work]) -> bool:
    """True once the transfer is known done; without ``is_completed`` it is found done only by waiting."""
    is_completed = getattr(work, "is_completed", None)
    return bool(is_completed()) if is_completed is not None else False


class P2P:
    def __init__(
        self,
        group: dist.ProcessGroup | None,
        pp_ranks: Sequence[int],
        device: torch.device,
        num_stages: int,
        num_microbatches: int,
        num_slices: int,
        window: int = SEND_WINDOW,
    ) -> None:
        """``pp_ranks[i]`` is the global rank of pipeline rank ``i`` in ``group``."""
        self.group = group
        self.pp_ranks = list(pp_ranks)
        self.device = device
        self.window = window
        self._dims = (num_stages, num_microbatches, num_slices)
        self._outstanding: dict[int, deque[_Sent]] = {}  # destination -> sends, oldest first
        self._posted: dict[tuple[int, int], list] = {}  # (src, tag) -> [buffer, work (None until issued)]
        self._batch: list[tuple[dist.P2POp, Any]] = []  # this communication point's operations, not yet issued
        self.ledger: Optional[InFlightBytes] = None  # counts in-flight buffers when set

    def tag(self, backward: bool, stage: int, microbatch: int, slice_: int) -> int:
        stages, mbs, slices = self._dims
        return (((int(backward) * stages + stage) * mbs + microbatch) * slices + slice_) % (2**31 - 1)

    def send(self, tensor: torch.Tensor, dst: int, tag: int, bounded: bool = True) -> None:
        """Post a send to pipeline rank ``dst``; if ``bounded``, first wait until fewer than
        ``window`` sends are outstanding on that link."""
        self.poll()
        queue = self._outstanding.setdefault(dst, deque())
        while bounded and len(queue) >= self.window:
            self._finish(queue.popleft(), wait=True)
        tensor = tensor.detach().contiguous()
        sent = _Sent(None, ("send", dst, tag))
        self._batch.append((dist.P2POp(dist.isend, tensor, self.pp_ranks[dst], self.group, tag), sent))
        queue.append(sent)
        if self.ledger is not None:
            self.ledger.add(sent.key, tensor.nbytes, received=False)

    def post(self, shape: Sequence[int], dtype: torch.dtype, src: int, tag: int) -> torch.Tensor:
        """Post the receive of message ``tag`` from pipeline rank ``src`` into a new buffer (returned);
        ``recv`` with the same ``src`` and ``tag`` waits for it."""
        if (src, tag) in self._posted:
            raise RuntimeError(f"receive from pipeline rank {src} tag {tag} posted twice")
        buffer = torch.empty(tuple(shape), dtype=dtype, device=self.device)
        self._posted[(src, tag)] = posted = [buffer, None]
        self._batch.append((dist.P2POp(dist.irecv, buffer, self.pp_ranks[src], self.group, tag), posted))
        return buffer

    def flush(self) -> None:
        """Issue this communication point's sends and receives as one ``batch_isend_irecv``."""
        if not self._batch:
            return
        batch, self._batch = self._batch, []
        works = dist.batch_isend_irecv([op for op, _ in batch])
        for (_, owner), work in zip(batch, works):
            if isinstance(owner, _Sent):
                owner.work = work
            else:
                owner[1] = work

    def is_posted(self, src: int, tag: int) -> bool:
        return (src, tag) in self._posted

    def recv(self, shape: Sequence[int], dtype: torch.dtype, src: int, tag: int) -> torch.Tensor:
        """Wait for message ``tag`` from ``src``: the receive posted for it, else one posted now."""
        if (src, tag) not in self._posted:
            self.post(shape, dtype, src, tag)
        self.flush()
        buffer, work = self._posted.pop((src, tag))
        if tuple(buffer.shape) != tuple(shape) or buffer.dtype != dtype:
            raise RuntimeError(
                f"receive from pipeline rank {src} tag {tag} was posted as {tuple(buffer.shape)} {buffer.dtype}, "
                f"awaited as {tuple(shape)} {dtype}"
            )
        work.wait()
        return buffer

    def poll(self) -> None:
        """Drop the handles of completed sends (oldest first on each link) so their buffers can go."""
        for queue in self._outstanding.values():
            while queue and _completed(queue[0].work):
                self._finish(queue.popleft(), wait=False)

    def _finish(self, sent: _Sent, wait: bool) -> None:
        if wait:
            if sent.work is None:
                self.flush()
            assert sent.work is not None  # None only for a rank outside the group
            sent.work.wait()
        if self.ledger is not None:
            self.ledger.remove(sent.key)

    def wait_all(self) -> None:
        """Wait for every send still outstanding (at the end of a step); a receive posted but never
        awaited is a planning error."""
        self.flush()
        if self._posted:
            raise RuntimeError(f"receives posted and never awaited (src, tag): {sorted(self._posted)}")
        for queue in self._outstanding.values():
            while queue:
                self._finish(queue.popleft(), wait=True)
