"""A taker's side of context exchange without context parallelism: serve blocks as they arrive.

While a taker action runs its own layers on the main thread, a server computes the blocks it
serves (``ExchangePlan.served``), each as soon as the sender's bytes are in: a server that waited
for the taker's own layer boundaries would hold every sender for up to a layer of the taker's
work. A block may be of either pass, whatever the taker's is: forward, unmasked attention of the
shipped Q to the shipped K/V rows, ``(out, lse)`` back; backward, the block's exact gradients
from the merged ``(out, lse)`` the sender shipped, fp32 ``(dq, dk, dv)`` back. No autograd: the
taker keeps nothing of a block.

One thread per served block, each blocking on its block's next header (``exchange_wire``): gloo's
``Work.is_completed()`` stays False until ``wait()`` is called, so one thread polling several
receives would never see an arrival there; a thread per block serves whichever sender is first
all the same. The sender's ``j``-th attention layer meets the thread's ``j``-th service (its
tags), and the sender's ``DONE`` header, sent when its action ends, ends the thread; a receive
that never comes fails with the process group's own timeout, and the error is raised on the main
thread by ``join`` (at the end of the taker's action), never swallowed.

Under context parallelism the taker stage's CP ranks compute each block together, by collectives
(``exchange_cp_server.py``), so there one thread serves the blocks in plan order instead.

NCCL (untested here, no GPU): the code is device-agnostic; each thread runs on its own CUDA
stream, and ``group`` must be the exchange's own group (``megatron/slimpipe/exchange_group.py``)
so its messages never queue behind the pipeline's activations.
"""

from __future__ import annotations

import threading
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from megatron_slim.runtime.pipeline.exchange_wire import (
    Attend,
    Gradients,
    Header,
    empty_header,
    layer_tag,
    post,
    wait_all,
)

Tensor = torch.Tensor


@dataclass(frozen=True)
class ServedBlock:
    index: int  # in the plan's order: the same on both ends, so the tags agree
    sender: int  # the sender's rank in ``group``
    backward: bool  # the block's pass (its sender's)


class BlockServer:
    def __init__(self, blocks: Sequence[ServedBlock], group, device: torch.device, backend_for: Callable) -> None:
        """``backend_for(header)``: the attention backend for a block of ``header``'s dtype."""
        self.group, self.device, self._backend_for = group, device, backend_for
        self.layers = [0] * len(blocks)  # layers served, per block
        self._errors: list[tuple[ServedBlock, BaseException]] = []
        self._threads = [
            threading.Thread(target=self._run, args=(i, b), name=f"exchange-block-{b.index}", daemon=True)
            for i, b in enumerate(blocks)
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def wait_threads(self) -> None:
        """Wait until every thread has ended (errors stay for :meth:`join`)."""
        for thread in self._threads:
            thread.join()

    def join(self) -> int:
        """Wait until every block's sender is done; re-raise a thread's error; the layers served."""
        for thread in self._threads:
            thread.join()
        if self._errors:
            block, error = self._errors[0]
            raise RuntimeError(
                f"context exchange: serving block {block.index} (sender rank {block.sender}) failed: {error}"
            ) from error
        return sum(self.layers)

    def _kernels(self, backend, scale: float) -> tuple[Attend, Gradients]:
        """The block's forward and backward: plain unmasked attention (no CP)."""

        def attend(q, k, v):
            return backend.forward(q, k, v, causal=False, softmax_scale=scale)

        def gradients(dout, q, out, lse, k, v):
            return backend.backward(dout, q, k, v, out, lse, causal=False, softmax_scale=scale)

        return attend, gradients

    def _on_stream(self):
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        return torch.cuda.stream(stream) if stream is not None else nullcontext()

    def _run(self, i: int, block: ServedBlock) -> None:
        try:
            with torch.no_grad(), self._on_stream():
                while self._serve_layer(block, self.layers[i]):
                    self.layers[i] += 1
        except BaseException as error:  # noqa: BLE001 - handed to the main thread by join()
            self._errors.append((block, error))

    def _serve_layer(self, block: ServedBlock, layer: int) -> bool:
        """Serve the block's ``layer``; False once its sender is done."""
        tag = layer_tag(block.index, layer)
        buffer = empty_header(self.device)
        dist.recv(buffer, block.sender, self.group, tag)
        head = Header.decode(buffer)
        if head.done:
            return False
        attend, gradients = self._kernels(self._backend_for(head), head.scale)
        if block.backward:
            shapes = (head.q_shape, head.q_shape, head.q_shape, head.lse_shape, head.kv_shape, head.kv_shape)
            dout, q, out, lse, k, v = self._receive(block, tag + 1, shapes, head.dtype, lse_at=3)
            grads = gradients(dout, q, out, lse, k, v)
            self._reply(block, tag + 7, tuple(g.float() for g in grads))
        else:
            q, k, v = self._receive(block, tag + 1, (head.q_shape, head.kv_shape, head.kv_shape), head.dtype)
            out, lse = attend(q, k, v)
            self._reply(block, tag + 4, (out, lse.float()))
        return True

    def _receive(self, block: ServedBlock, tag: int, shapes, dtype: torch.dtype, lse_at: int = -1) -> list[Tensor]:
        buffers = [
            torch.empty(shape, dtype=torch.float32 if i == lse_at else dtype, device=self.device)
            for i, shape in enumerate(shapes)
        ]
        wait_all(post(dist.irecv, buffers, block.sender, self.group, tag))
        return buffers

    def _reply(self, block: ServedBlock, tag: int, tensors: tuple[Tensor, ...]) -> None:
        # the sender posted these receives with its sends
        wait_all(post(dist.isend, [t.contiguous() for t in tensors], block.sender, self.group, tag))
