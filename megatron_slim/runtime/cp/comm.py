"""Point-to-point messages between CP ranks over one injected process group.

Plans name CP ranks ``0 .. C-1``; ``Comm`` maps them to the group's global ranks and never creates
a process group (plans change every step). No tags: NCCL ignores them, so correctness rests on
both ends of every directed pair posting their messages in the same order, which the engine's
fixed program order guarantees; gloo, which would honour tags, is run the same way so the CPU
tests exercise that guarantee. Sends are waited on only when the pass ends (``drain``): a rank
never blocks on its own send.

Both directions between two ranks share NCCL's ordering too (one stream per pair, a large send
waiting for its receive), so the messages a rank posts at one point (an exchange stage's receives
and sends, ``flush``) go out as one ``batch_isend_irecv``, which NCCL runs as one group; a
receive's handle issues its point's batch if it is waited on first (``runtime/nccl_rules`` checks
all of this on gloo).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

Tensor = torch.Tensor


class Comm:
    def __init__(self, group: dist.ProcessGroup | None) -> None:
        """``group``: the CP process group (``None``: the default group); CP rank ``i`` is its
        ``i``-th rank, as in megatron's ``get_context_parallel_rank``."""
        self.group = group if group is not None else dist.group.WORLD
        self.ranks = tuple(dist.get_process_group_ranks(self.group))
        self.me = self.ranks.index(dist.get_rank())
        self._sends: list[tuple["_Issued", Tensor]] = []
        self._batch: list[tuple[dist.P2POp, "_Issued"]] = []

    @property
    def size(self) -> int:
        return len(self.ranks)

    def send(self, tensor: Tensor, to: int) -> None:
        if not tensor.is_contiguous():
            raise ValueError("send: tensor must be contiguous")
        handle = _Issued(self)
        self._batch.append((dist.P2POp(dist.isend, tensor, self.ranks[to], self.group), handle))
        self._sends.append((handle, tensor))

    def recv(self, buffer: Tensor, frm: int) -> "_Issued":
        if not buffer.is_contiguous():
            raise ValueError("recv: buffer must be contiguous")
        handle = _Issued(self)
        self._batch.append((dist.P2POp(dist.irecv, buffer, self.ranks[frm], self.group), handle))
        return handle

    def flush(self) -> None:
        """Issue the sends and receives posted since the last flush as one batch."""
        if self._batch:
            batch, self._batch = self._batch, []
            for (_, handle), work in zip(batch, dist.batch_isend_irecv([op for op, _ in batch])):
                handle.work = _posted(work)

    def drain(self) -> None:
        """Wait for every send posted so far (their tensors stay alive until then)."""
        self.flush()
        for handle, _ in self._sends:
            handle.wait()
        self._sends.clear()


class _Issued:
    """A send's or receive's handle; waiting on it first issues its batch if that is still open."""

    def __init__(self, comm: Comm) -> None:
        self._comm = comm
        self.work: dist.Work | None = None

    def wait(self) -> bool:
        if self.work is None:
            self._comm.flush()
        return bool(_posted(self.work).wait())


def _posted(work: dist.Work | None) -> dist.Work:
    """torch types isend/irecv's handle as optional: it is None only for a rank outside the group,
    and every peer here is one of ``Comm.ranks``."""
    assert work is not None
    return work
