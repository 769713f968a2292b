"""A taker's side of context exchange under query-out context parallelism: one thread, plan order.

Each CP rank of a sender stage ships its own shards to the CP rank of the same index on the taker
stage (they share a pipeline group): its rows of the slice's queries and its rows of the block's
K/V (``cp_exchange.py``). The taker stage's CP ranks then run the block query-out among
themselves, as the sender stage would have: all-gather the shipped query shards, attend every query
to the local K/V rows without a mask, and all-to-all the partials back to the rank whose queries
they are, merged by log-sum-exp (forward); all-gather (q, dout, out, lse), the block's exact
gradients from the merged statistics, reduce-scatter (sum) of dQ (backward). Row order inside the
block does not matter (no mask): queries stay rank-major, never reordered to positions, and a CP
rank may hold no K/V row of a block at all (its partial then has lse = -inf).

Why one thread serving in plan order, layer-major (for layer ``j``: every block in plan order),
rather than :class:`BlockServer`'s thread per block: every CP rank of the taker stage must run the
same collectives in the same order, and threads would race to the group in any order. Plan order is
the same on every CP rank, and the senders' CP ranks post their ``j``-th layer's messages before
they wait for any reply, so serving them one after another cannot wait on itself.

Why a group of its own (``cp_group``, ``megatron/slimpipe/exchange_group.exchange_cp_group``): the
taker's main thread runs its own attention's CP collectives meanwhile; two threads' collectives on
one group would interleave differently on different ranks (gloo and NCCL match collectives by
order), so the server's travel on a second group over the same CP ranks.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_slim.runtime.pipeline.cp_collectives import all_gather, combine_partials, reduce_scatter_sum
from megatron_slim.runtime.pipeline.exchange_server import BlockServer, ServedBlock
from megatron_slim.runtime.pipeline.exchange_wire import Attend, Gradients

Tensor = torch.Tensor


def _joined(gathered: Tensor) -> Tensor:
    """``[cp, b, rows, ...]`` -> ``[b, cp * rows, ...]``, rank-major."""
    return gathered.movedim(0, 1).flatten(1, 2)


def _split(x: Tensor, cp: int, dim: int) -> Tensor:
    """Inverse of :func:`_joined` along ``dim``: ``[cp, ...]``, entry ``i`` holding rank ``i``'s rows."""
    return x.unflatten(dim, (cp, x.shape[dim] // cp)).movedim(dim, 0)


def block_attention(backend, scale: float, group) -> tuple[Attend, Gradients]:
    """The taker stage's query-out forward and backward of a shipped block on ``group``."""
    cp = dist.get_world_size(group)

    def attend(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        q_all = _joined(all_gather([q], group)[0])
        acc = torch.promote_types(q.dtype, torch.float32)
        if k.shape[1] == 0:  # this CP rank holds none of the block's rows
            b, rows, hq, _ = q_all.shape
            out = torch.zeros((b, rows, hq, v.shape[-1]), dtype=acc, device=q.device)
            lse = torch.full((b, hq, rows), float("-inf"), dtype=torch.float32, device=q.device)
        else:
            out, lse = backend.forward(q_all, k, v, causal=False, softmax_scale=scale)
        mine = combine_partials(_split(out.to(acc), cp, 1), _split(lse.float(), cp, 2), group)
        return mine[0].to(q.dtype), mine[1]

    def gradients(dout: Tensor, q: Tensor, out: Tensor, lse: Tensor, k: Tensor, v: Tensor):
        q_all, dout_all, out_all, lse_all = all_gather([q, dout, out, lse], group)
        lse_all = lse_all.movedim(0, 2).flatten(2, 3)  # [cp, b, h, rows] -> [b, h, cp * rows]
        if k.shape[1] == 0:  # no rows here: no gradient of this rank's keys, none to the queries
            dq = torch.zeros(_joined(q_all).shape, dtype=torch.float32, device=q.device)
            dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
            dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        else:
            dq, dk, dv = backend.backward(
                _joined(dout_all), _joined(q_all), k, v, _joined(out_all), lse_all, causal=False, softmax_scale=scale
            )
        return reduce_scatter_sum(_split(dq.float(), cp, 1), group), dk, dv

    return attend, gradients


class CPBlockServer(BlockServer):
    def __init__(
        self,
        blocks: Sequence[ServedBlock],
        group,
        device: torch.device,
        backend_for: Callable,
        cp_group,
        after: Optional["CPBlockServer"] = None,
    ) -> None:
        """``cp_group``: the exchange's own group over the taker stage's CP ranks; ``after``: the
        rank's previous CP server, which this one waits for before its first collective (two
        servers' collectives on one group must not interleave)."""
        super().__init__(blocks, group, device, backend_for)
        self.cp_group, self._blocks, self._after = cp_group, list(blocks), after
        self._threads = [threading.Thread(target=self._serve_all, name="exchange-cp-blocks", daemon=True)]

    def _kernels(self, backend, scale: float) -> tuple[Attend, Gradients]:
        return block_attention(backend, scale, self.cp_group)

    def _serve_all(self) -> None:
        """Layer by layer, every block whose sender is not done, in plan order."""
        active = list(enumerate(self._blocks))
        layer, current = 0, self._blocks[0]
        if self._after is not None:
            self._after.wait_threads()
        try:
            with torch.no_grad(), self._on_stream():
                while active:
                    still = []
                    for i, block in active:
                        current = block
                        if self._serve_layer(block, layer):
                            self.layers[i] += 1
                            still.append((i, block))
                    active, layer = still, layer + 1
        except BaseException as error:  # noqa: BLE001 - handed to the main thread by join()
            self._errors.append((current, error))
