"""Point-to-point messages between CP ranks over one injected process group.

Plans name CP ranks ``0 .. C-1``; ``Comm`` maps them to the group's global ranks and never creates
a process group (plans change every step). No tags: NCCL ignores them, so correctness rests on
both ends of every directed pair posting their messages in the same order, which the engine's
fixed program order guarantees; gloo, which would honour tags, is run the same way so the CPU
tests exercise that guarantee. Sends are waited on only when the pass ends (``drain``): a rank
never blocks on its own send.
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
        self._sends: list[tuple[dist.Work, Tensor]] = []

    @property
    def size(self) -> int:
        return len(self.ranks)

    def send(self, tensor: Tensor, to: int) -> None:
        if not tensor.is_contiguous():
            raise ValueError("send: tensor must be contiguous")
        self._sends.append((_posted(dist.isend(tensor, dst=self.ranks[to], group=self.group)), tensor))

    def recv(self, buffer: Tensor, frm: int) -> dist.Work:
        if not buffer.is_contiguous():
            raise ValueError("recv: buffer must be contiguous")
        return _posted(dist.irecv(buffer, src=self.ranks[frm], group=self.group))

    def drain(self) -> None:
        """Wait for every send posted so far (their tensors stay alive until then)."""
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()


def _posted(work: dist.Work | None) -> dist.Work:
    """torch types isend/irecv's handle as optional: it is None only for a rank outside the group,
    and every peer here is one of ``Comm.ranks``."""
    assert work is not None
    return work
