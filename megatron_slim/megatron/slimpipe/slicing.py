"""Make megatron-core model chunks slice-aware: K/V-cached core attention and offset RoPE.

``SliceCoreAttention`` is the core attention to put in a layer spec; ``attach_slicing`` then
points every instance in a chunk at the run's ``SliceContext`` and the chunk's ``KVCacheStore``,
and wraps the chunk's rotary embedding so slice ``j`` gets positions ``start_j ..``. Outside a
schedule (no current slice) the attention is plain causal attention over what it is given.

Context parallelism (the attention's ``pg_collection.cp`` has more than one rank): each slice
arrives split zigzag-wise over the CP ranks (megatron's ``get_batch_on_this_cp_rank`` applied to
the slice), and the attention is :func:`cp_sliced_attention` ("query-out"). RoPE needs nothing
more: megatron's rotary table (and ``CpuRotaryEmbedding``) is built for ``local * cp`` positions
from the offset ``SliceRotary`` adds, then cut zigzag-wise, so a rank's tokens get
``slice start + their zigzag positions within the slice``. Outside a schedule under CP the local
tokens are taken as the zigzag shard of one whole sequence (uncached CP attention).

Packed windows: when the slicing data iterator recorded document lengths for the current
microbatch (``SliceContext.documents``: the batch key ``document_lengths`` or a block-causal
attention mask), attention stays inside each document (varlen kernels of the chosen backend) and
RoPE positions restart at 0 in each document, also under SlimPipe's CP attention; under tensor
parallelism only when every TP rank reads its own batch (``SliceContext.documents_on_every_tp_rank``).
Megatron's THD ``packed_seq_params`` work outside a schedule (whole windows) and are refused inside
a slice, where the ``document_lengths`` key is the way in.

A window a CP engine planned (``SliceContext.cp_shares`` holds the microbatch's shares, set by
``megatron-slim train``'s ``train/cp_slices.py`` or the launcher's ``slimpipe/engine_slices.py``):
each rank holds the plan's rows of the slice, not the zigzag split; the attention is
:func:`planned_slice_attention` and RoPE cuts the slice's document positions to those rows.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from megatron_slim.megatron.model.core_attention import SlimCoreAttention
from megatron_slim.megatron.model.rotary import rope_table, zigzag_positions
from megatron_slim.megatron.model.wrapping import RotaryWrapper, wrap_rotary
from megatron_slim.runtime.pipeline.context_exchange import paired_role
from megatron_slim.runtime.pipeline.cp_planned_attention import planned_slice_attention
from megatron_slim.runtime.pipeline.cp_slice_attention import cp_sliced_attention
from megatron_slim.runtime.pipeline.documents import DOCUMENT_LENGTHS, slice_documents, slice_positions
from megatron_slim.runtime.pipeline.kv_cache import KVCacheStore
from megatron_slim.runtime.pipeline.slice_attention import sliced_attention
from megatron_slim.runtime.pipeline.slice_context import SliceContext, SliceInfo


class SliceCoreAttention(SlimCoreAttention):
    context: Optional[SliceContext] = None
    store: Optional[KVCacheStore] = None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        info = self.context.current if self.context is not None else None
        cp_group = self.cp_group
        under_cp = cp_group is not None and cp_group.size() > 1
        if info is None:
            if under_cp:
                return cp_sliced_attention(
                    q, k, v, backend=self.attention_backend(q), softmax_scale=self.softmax_scale, group=cp_group
                )
            return super().attend(q, k, v)
        if self.store is None:
            raise RuntimeError(
                f"layer {self.layer_number}: slice attention has no K/V cache store attached "
                "(call megatron_slim.megatron.slimpipe.slicing.attach_slicing)"
            )
        documents = self._documents(info, q)
        shares = self.context.cp_shares.get(info.microbatch) if self.context is not None else None
        common = dict(
            backend=self.attention_backend(q),
            softmax_scale=self.softmax_scale,
            store=self.store,
            info=info,
            layer=self.layer_number,
        )
        if under_cp and shares is not None:
            if documents is None:
                raise RuntimeError(f"microbatch {info.microbatch}: a CP-planned window needs its document lengths")
            assert self.context is not None  # a current slice comes from the context
            paired_role(self.context.exchange, True, info.recompute)  # refuses a paired action: not run here
            return planned_slice_attention(q, k, v, group=cp_group, documents=documents, shares=shares, **common)
        if under_cp:
            exchange = self.context.exchange if self.context is not None else None
            return cp_sliced_attention(q, k, v, group=cp_group, documents=documents, exchange=exchange, **common)
        return sliced_attention(
            q,
            k,
            v,
            documents=slice_documents(documents, info.start, info.length) if documents is not None else None,
            exchange=self.context.exchange if self.context is not None else None,
            **common,
        )

    def attend_documents(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: tuple[int, ...]
    ) -> torch.Tensor:
        if self.context is not None and self.context.current is not None:
            raise ValueError(
                "packed_seq_params (THD) inside a SlimPipe slice: megatron's THD offsets describe the whole "
                f"window, not the slice; allowed: the batch key {DOCUMENT_LENGTHS!r} (docs/packing.md) with "
                "packed_seq_params=None"
            )
        return super().attend_documents(q, k, v, lengths)

    def _documents(self, info: SliceInfo, q: torch.Tensor) -> Optional[tuple[int, ...]]:
        """The document lengths of the current microbatch if it is a packed window, else None."""
        assert self.context is not None
        lengths = self.context.documents.lookup(info.microbatch)
        if lengths is None:
            return None
        tp_group = self.tp_group
        if tp_group is not None and tp_group.size() > 1 and not self.context.documents_on_every_tp_rank:
            raise ValueError(
                f"{DOCUMENT_LENGTHS}: packed windows under SlimPipe with tensor parallel size {tp_group.size()} "
                "and Megatron's TP batch broadcast (it carries tensors only, so the other TP ranks would not see "
                "the documents); allowed: tp=1, or every TP rank reading its own batch "
                "(SliceContext(documents_on_every_tp_rank=True), as megatron-slim train does)"
            )
        if q.shape[0] != 1:
            raise ValueError(f"{DOCUMENT_LENGTHS}: micro-batch size {q.shape[0]}; allowed: 1 (one packed window)")
        return lengths


class SliceRotary(RotaryWrapper):
    """Wraps a chunk's rotary embedding: the table starts at the current slice's first position."""

    def forward(self, max_seq_len: int, offset: int = 0, *args: Any, **kwargs: Any) -> torch.Tensor:
        info = self.context.current
        start = info.start if info is not None else 0
        documents = self.context.documents.lookup(info.microbatch) if info is not None else None
        if documents is not None:
            shares = self.context.cp_shares.get(info.microbatch)
            # megatron asks for (local rows x cp) positions: the slice under zigzag, any count under a CP plan
            if offset or (shares is None and max_seq_len != info.length):
                raise ValueError(
                    f"{DOCUMENT_LENGTHS}: rotary table of {max_seq_len} positions at offset {offset} for a slice "
                    f"of {info.length} tokens; allowed: the whole slice at offset 0 (before any context-parallel split)"
                )
            positions = torch.tensor(slice_positions(documents, info.start, info.length))
            cp_group = kwargs.get("cp_group") or getattr(self.inner, "cp_group", None)
            if cp_group is not None and cp_group.size() > 1 and shares is not None:
                positions = positions[shares[info.slice].local_rows(cp_group.rank())]
            elif cp_group is not None and cp_group.size() > 1 and not kwargs.get("packed_seq", False):
                positions = positions[zigzag_positions(info.length, cp_group.rank(), cp_group.size())]
            return rope_table(self.inner, positions)  # on the table's device
        return self.inner(max_seq_len, offset + start, *args, **kwargs)


def attach_slicing(
    chunk: torch.nn.Module, context: SliceContext, store: KVCacheStore, preferred_backend: Optional[str] = None
) -> int:
    """Point ``chunk``'s slice attentions at ``context``/``store``; wrap its rotary embedding.

    Returns how many slice attentions were found (0 means the spec lacks SliceCoreAttention:
    the caller must refuse to run sliced).
    """
    found = 0
    for module in chunk.modules():
        if isinstance(module, SliceCoreAttention):
            module.context, module.store = context, store
            if preferred_backend not in (None, "auto"):
                module.preferred_backend, module._backend = preferred_backend, None
            found += 1
    wrap_rotary(chunk, SliceRotary, context)
    return found
