"""Point-to-point transfers between pipeline ranks for the interpreter's SEND/RECV actions.

Every message is tagged with (direction, stage, microbatch, slice) so gloo matches it exactly;
for NCCL, which ignores tags, the planner guarantees each directed link carries its messages in
the same order on both ends (``plan.schedule.validate.check_link_order``).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist


class P2P:
    def __init__(
        self,
        group: dist.ProcessGroup | None,
        pp_ranks: Sequence[int],
        device: torch.device,
        num_stages: int,
        num_microbatches: int,
        num_slices: int,
    ) -> None:
        """``pp_ranks[i]`` is the global rank of pipeline rank ``i`` in ``group``."""
        self.group = group
        self.pp_ranks = list(pp_ranks)
        self.device = device
        self._dims = (num_stages, num_microbatches, num_slices)
        self._pending: list[dist.Work] = []

    def tag(self, backward: bool, stage: int, microbatch: int, slice_: int) -> int:
        stages, mbs, slices = self._dims
        return (((int(backward) * stages + stage) * mbs + microbatch) * slices + slice_) % (2**31 - 1)

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        tensor = tensor.detach().contiguous()
        work = dist.isend(tensor, dst=self.pp_ranks[dst], group=self.group, tag=tag)
        assert work is not None  # None only for a rank outside the group
        self._pending.append(work)

    def recv(self, shape: Sequence[int], dtype: torch.dtype, src: int, tag: int) -> torch.Tensor:
        buffer = torch.empty(tuple(shape), dtype=dtype, device=self.device)
        work = dist.irecv(buffer, src=self.pp_ranks[src], group=self.group, tag=tag)
        assert work is not None  # None only for a rank outside the group
        work.wait()
        return buffer

    def wait_all(self) -> None:
        """Sends are waited on only at the end: a rank never blocks on its own send."""
        for work in self._pending:
            work.wait()
        self._pending.clear()
