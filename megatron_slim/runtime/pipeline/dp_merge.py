"""DP-merge at run time: this DP rank's side of the iteration's head/tail transfers
(``plan/pack/dp_merge.py`` states the shape, the messages and the order that cannot deadlock).

A transfer's head rows are a document of the head rank's window; the tail rows, on the tail rank,
are the same sample's later tokens. At every attention layer:

* head, forward of its send slice: the head rows' K and V (from the cache chunks and the slice's
  own K/V) are sent without waiting (``isend``; the tensors stay alive until ``finish``);
* tail, forward of its receive slice: they are received and kept per (transfer, layer); every slice
  touching the tail joins them in front of the tail document's keys (the varlen sequence of that
  document grows by the prefix, still bottom-right causal: its queries are the last of its keys),
  and its rotary positions continue after the prefix (``position_shift``);
* tail, backward: each slice's dK/dV of those rows add into an fp32 buffer; the receive slice's
  backward (the last to touch the tail) sends the sum and frees both;
* head, backward of its send slice (the first to touch the head): the sum is received and added to
  the head rows' gradient, the earlier slices' rows into their cache accumulators.

Messages are tagged by (transfer, layer, kind) in a range of their own, below the context exchange's
(``exchange_wire.TAG_BASE``), so gloo never matches two of them crosswise.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_slim.plan.pack.dp_merge import MergeTransfer
from megatron_slim.runtime.pipeline.documents import SliceDocuments
from megatron_slim.runtime.pipeline.kv_cache import KVCacheStore
from megatron_slim.runtime.pipeline.slice_context import SliceInfo

TAG_BASE = 2**29
_LAYERS = 4096
K, V, DK, DV = range(4)

Spot = tuple[int, int, int]  # (transfer index, row of the joined keys where its prefix starts, prefix rows)


def _tag(index: int, layer: int, kind: int) -> int:
    return TAG_BASE + (index * _LAYERS + layer) * 4 + kind


def _overlaps(row: int, length: int, info: SliceInfo) -> bool:
    return row < info.start + info.length and info.start < row + length


class MergeLink:
    """The transfers of one iteration on one DP rank, over the DP group ``group``."""

    def __init__(self, group, slice_lengths: Sequence[int]) -> None:
        self.group, self.slice_lengths = group, tuple(slice_lengths)
        self.heads: dict[int, list[tuple[int, MergeTransfer]]] = {}
        self.tails: dict[int, list[tuple[int, MergeTransfer]]] = {}
        self.foreign: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.grads: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.pending: list[tuple[object, torch.Tensor]] = []
        self.messages = 0  # K/V and dK/dV tensors this rank sent and received (tests count them)

    def prepare(self, transfers: Sequence[MergeTransfer], dp_rank: int) -> None:
        self.finish()
        self.heads, self.tails = {}, {}
        for i, t in enumerate(transfers):
            if t.head.rank == dp_rank:
                self.heads.setdefault(t.head.window, []).append((i, t))
            if t.tail.rank == dp_rank:
                self.tails.setdefault(t.tail.window, []).append((i, t))

    def finish(self) -> None:
        """Wait for this rank's sends; after an iteration nothing may be left."""
        for work, _ in self.pending:
            work.wait()  # type: ignore[attr-defined]
        self.pending = []
        if self.foreign or self.grads:
            raise RuntimeError(f"DP-merge: K/V of transfers {sorted(self.foreign)} never returned their dK/dV")

    def _peer(self, dp_rank: int) -> int:
        return dist.get_global_rank(self.group, dp_rank)

    def _send(self, tensor: torch.Tensor, dp_rank: int, tag: int) -> None:
        tensor = tensor.contiguous()
        self.pending.append((dist.isend(tensor, self._peer(dp_rank), group=self.group, tag=tag), tensor))
        self.messages += 1

    def _receive(self, like: torch.Tensor, rows: int, dtype, dp_rank: int, tag: int) -> torch.Tensor:
        out = torch.empty(like.shape[0], rows, *like.shape[2:], dtype=dtype, device=like.device)
        dist.recv(out, self._peer(dp_rank), group=self.group, tag=tag)
        self.messages += 1
        return out

    def position_shift(self, info: SliceInfo) -> Optional[torch.Tensor]:
        """Per slice row, what to add to its in-document position: the prefix, on tail rows."""
        tails = [t for _, t in self.tails.get(info.microbatch, ()) if _overlaps(t.tail.row, t.tail.length, info)]
        if not tails:
            return None
        shift = torch.zeros(info.length, dtype=torch.long)
        for t in tails:
            a, b = max(t.tail.row, info.start) - info.start, min(t.tail.row + t.tail.length, info.start + info.length)
            shift[a : b - info.start] = t.prefix
        return shift

    # ---- tail ------------------------------------------------------------------------------
    def _foreign(self, index: int, t: MergeTransfer, info: SliceInfo, layer: int, like: torch.Tensor):
        key = (index, layer)
        if key not in self.foreign:
            receive = t.tail.slice_at(self.slice_lengths, last=False)
            if info.slice != receive or info.recompute:
                raise RuntimeError(
                    f"DP-merge: slice {info.slice} of microbatch {info.microbatch} needs the K/V of "
                    f"transfer {index} first received by slice {receive}"
                )
            k = self._receive(like, t.prefix, like.dtype, t.head.rank, _tag(index, layer, K))
            self.foreign[key] = (k, self._receive(like, t.prefix, like.dtype, t.head.rank, _tag(index, layer, V)))
        return self.foreign[key]

    def join_foreign(self, info: SliceInfo, layer: int, keys, values, documents: Optional[SliceDocuments]):
        """The slice's keys/values and documents with each touched tail's foreign prefix in front of
        its document; and where the prefixes went (for ``strip_foreign``)."""
        tails = [(i, t) for i, t in self.tails.get(info.microbatch, ()) if _overlaps(t.tail.row, t.tail.length, info)]
        if not tails:
            return keys, values, documents, []
        if documents is None:
            raise RuntimeError(f"DP-merge: microbatch {info.microbatch} holds a tail but no document_lengths")
        k_lengths, spots, shift = list(documents.k_lengths), [], 0
        starts = [documents.key_start, *(documents.key_start + n for n in accumulate(k_lengths))]
        for i, t in sorted(tails, key=lambda it: it[1].tail.row):
            fk, fv = self._foreign(i, t, info, layer, keys)
            at = t.tail.row - documents.key_start + shift
            keys = torch.cat([keys[:, :at], fk, keys[:, at:]], dim=1)
            values = torch.cat([values[:, :at], fv, values[:, at:]], dim=1)
            k_lengths[starts.index(t.tail.row)] += t.prefix
            spots.append((i, at, t.prefix))
            shift += t.prefix
        return keys, values, SliceDocuments(documents.key_start, documents.q_lengths, tuple(k_lengths)), spots

    def strip_foreign(self, info: SliceInfo, layer: int, dkeys, dvalues, spots: list[Spot]):
        """``dkeys``/``dvalues`` without the foreign rows, whose gradients add into their buffers; the
        receive slice sends the sums back to the head rank."""
        for i, at, rows in reversed(spots):
            dk, dv = dkeys[:, at : at + rows].float(), dvalues[:, at : at + rows].float()
            dkeys = torch.cat([dkeys[:, :at], dkeys[:, at + rows :]], dim=1)
            dvalues = torch.cat([dvalues[:, :at], dvalues[:, at + rows :]], dim=1)
            if (i, layer) in self.grads:
                self.grads[(i, layer)][0].add_(dk)
                self.grads[(i, layer)][1].add_(dv)
            else:
                self.grads[(i, layer)] = (dk.clone(), dv.clone())
            t = next(t for j, t in self.tails[info.microbatch] if j == i)
            if info.slice == t.tail.slice_at(self.slice_lengths, last=False):
                gk, gv = self.grads.pop((i, layer))
                del self.foreign[(i, layer)]
                self._send(gk, t.head.rank, _tag(i, layer, DK))
                self._send(gv, t.head.rank, _tag(i, layer, DV))
        return dkeys, dvalues

    # ---- head ------------------------------------------------------------------------------
    def _sending(self, info: SliceInfo) -> list[tuple[int, MergeTransfer]]:
        heads = self.heads.get(info.microbatch, ())
        return [(i, t) for i, t in heads if t.head.slice_at(self.slice_lengths, last=True) == info.slice]

    def send_heads(self, info: SliceInfo, layer: int, prefix: list, k: torch.Tensor, v: torch.Tensor) -> None:
        """Forward of a send slice: the head rows' K/V (window rows up to the slice's end) to the tail."""
        sending = [] if info.recompute else self._sending(info)
        if not sending:
            return
        keys = torch.cat([k_i for k_i, _ in prefix] + [k], dim=1).detach()
        values = torch.cat([v_i for _, v_i in prefix] + [v], dim=1).detach()
        for i, t in sending:
            rows = slice(t.head.row, t.head.row + t.head.length)
            self._send(keys[:, rows], t.tail.rank, _tag(i, layer, K))
            self._send(values[:, rows], t.tail.rank, _tag(i, layer, V))

    def add_head_grads(self, info: SliceInfo, layer: int, store: KVCacheStore, prefix: list, dk, dv):
        """Backward of a send slice: the tail's dK/dV of the head rows, into the earlier slices'
        accumulators and this slice's own ``dk``/``dv`` (returned)."""
        for i, t in self._sending(info):
            gk = self._receive(dk, t.head.length, torch.float32, t.tail.rank, _tag(i, layer, DK))
            gv = self._receive(dk, t.head.length, torch.float32, t.tail.rank, _tag(i, layer, DV))
            chunk_start = 0
            for c, (k_c, _) in enumerate([*prefix, (dk, None)]):
                a = max(t.head.row, chunk_start)
                b = min(t.head.row + t.head.length, chunk_start + k_c.shape[1])
                if a < b:
                    part = slice(a - t.head.row, b - t.head.row)
                    if c < len(prefix):
                        zk, zv = (
                            k_c.new_zeros(k_c.shape, dtype=torch.float32),
                            k_c.new_zeros(k_c.shape, dtype=torch.float32),
                        )
                        zk[:, a - chunk_start : b - chunk_start] = gk[:, part]
                        zv[:, a - chunk_start : b - chunk_start] = gv[:, part]
                        store.accumulate(info.microbatch, layer, c, zk, zv)
                    else:
                        rows = slice(a - chunk_start, b - chunk_start)
                        dk, dv = dk.clone(), dv.clone()
                        dk[:, rows] += gk[:, part].to(dk.dtype)
                        dv[:, rows] += gv[:, part].to(dv.dtype)
                chunk_start += k_c.shape[1]
        return dk, dv
