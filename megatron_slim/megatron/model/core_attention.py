"""A plugin core attention for megatron-core's ``SelfAttention`` (0.14 .. 0.19).

megatron computes Q/K/V (and applies RoPE) itself and hands them to the core attention;
:class:`SlimCoreAttention` honours that contract and reduces it to one overridable seam,
:meth:`SlimCoreAttention.attend`, in batch-first layout. Subclasses add a K/V cache for sequence
slices or context parallelism by overriding ``attend`` (or ``forward`` around it); a kernel library
plugs in the same way.

Constructor contract: megatron calls ``core_attention(config=, layer_number=, attn_mask_type=,
attention_type=, cp_comm_type=, softmax_scale=, pg_collection=)`` (0.15+; 0.14 passes
``model_comm_pgs=`` instead of ``pg_collection=``). Unknown keywords are accepted and kept in
``self.extra_kwargs`` so a newer megatron adding one does not break construction.
"""

from __future__ import annotations

import math
from itertools import accumulate
from typing import TYPE_CHECKING, Any, Optional, cast

import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from megatron_slim.megatron.model.packed_seq import PACKED_SEQ_PARAMS, thd_documents

if TYPE_CHECKING:
    from megatron_slim.runtime.attention.backend import AttentionBackend

SUPPORTED_MASK_TYPES = (AttnMaskType.causal,)
THD_MASK_TYPES = (AttnMaskType.causal, AttnMaskType.padding_causal)  # megatron marks THD packs padding_causal


class SlimCoreAttention(MegatronModule):
    """Causal (grouped-query) core attention with a single math seam, :meth:`attend`."""

    _backend: Optional[AttentionBackend]  # chosen on first use (attention_backend)

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type=AttnMaskType.causal,
        attention_type: str = "self",
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Any = None,
        model_comm_pgs: Any = None,
        **extra_kwargs: Any,
    ):
        super().__init__(config=config)
        if attention_type != "self":
            raise ValueError(f"attention_type={attention_type!r}: allowed values are 'self'")
        config_dropout = getattr(config, "attention_dropout", 0.0)
        if attention_dropout not in (None, 0, 0.0) or config_dropout:
            raise ValueError(
                f"attention_dropout={attention_dropout or config.attention_dropout!r}: "
                "allowed value is 0 (this core attention has no dropout)"
            )
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.cp_comm_type = cp_comm_type
        self.pg_collection = pg_collection if pg_collection is not None else model_comm_pgs
        self.extra_kwargs = extra_kwargs
        head_dim = config.kv_channels or config.hidden_size // config.num_attention_heads
        self.head_dim = head_dim
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)

    @property
    def cp_group(self):
        return getattr(self.pg_collection, "cp", None)

    @property
    def tp_group(self):
        return getattr(self.pg_collection, "tp", None)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
        **unused: Any,
    ) -> torch.Tensor:
        """``query [sq, b, np, hn]``, ``key``/``value [sk, b, ng, hn]`` -> ``[sq, b, np*hn]``.

        ``attention_mask`` is ignored: the mask type is causal, which needs no explicit mask.
        With THD ``packed_seq_params`` megatron passes ``[t, np, hn]`` / ``[t, ng, hn]`` (batch
        squeezed) and gets ``[t, np*hn]`` (``megatron/model/packed_seq.py``).
        """
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        allowed = SUPPORTED_MASK_TYPES if packed_seq_params is None else THD_MASK_TYPES
        if mask_type not in allowed:
            raise ValueError(f"attn_mask_type={mask_type!r}: allowed values are {', '.join(str(m) for m in allowed)}")
        if attention_bias is not None:
            raise ValueError("attention_bias: allowed value is None (not supported)")
        if packed_seq_params is not None:
            return self._forward_thd(query, key, value, packed_seq_params)
        sq, b, heads, hn = query.shape
        q, k, v = (t.permute(1, 0, 2, 3) for t in (query, key, value))
        out = self.attend(q, k, v)  # [b, sq, np, hn]
        return out.permute(1, 0, 2, 3).reshape(sq, b, heads * hn)

    def _forward_thd(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params: Any) -> torch.Tensor:
        cp = self.cp_group
        documents = thd_documents(params, query.shape[0], cp.size() if cp is not None else 1)
        if query.dim() != 3:
            raise ValueError(
                f"query {tuple(query.shape)} with THD {PACKED_SEQ_PARAMS}: allowed: [tokens, heads, head_dim] "
                "(megatron squeezes the batch dimension of a THD pack)"
            )
        out = self.attend_documents(query, key, value, documents.lengths)
        if documents.padded:
            out = out * documents.real_rows(out.device)[:, None, None].to(out.dtype)
        return out.reshape(out.shape[0], -1)

    def attention_backend(self, q: torch.Tensor):
        """The kernel backend, chosen once (``runtime.attention.select_backend`` logs the choice);
        ``--megatron-slim-attention-backend`` / ``MEGATRON_SLIM_ATTENTION_BACKEND`` force one."""
        if getattr(self, "_backend", None) is None:
            from megatron_slim.runtime.attention import select_backend

            self._backend = select_backend(getattr(self, "preferred_backend", None), q.device, q.dtype)
        return self._backend

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention: ``q [b, sq, hq, d]``, ``k``/``v [b, sk, hkv, d]`` -> ``[b, sq, hq, d]``.

        Query head ``i`` reads K/V head ``i // (hq // hkv)``. When ``sk > sq`` the queries are the
        *last* ``sq`` positions (query ``i`` sees keys ``j <= i + sk - sq``), which is what a
        K/V cache of earlier slices needs.
        """
        from megatron_slim.runtime.attention import attention

        out = attention(q, k, v, causal=True, softmax_scale=self.softmax_scale, backend=self.attention_backend(q))
        return cast(torch.Tensor, out)  # without return_lse: the output alone

    def attend_documents(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: tuple[int, ...]
    ) -> torch.Tensor:
        """Causal attention inside each document: ``q [t, hq, d]``, ``k``/``v [t, hkv, d]`` with
        ``sum(lengths) == t`` -> ``[t, hq, d]``; no token sees an earlier document."""
        from megatron_slim.runtime.attention import varlen_attention

        cu = torch.tensor([0, *accumulate(lengths)], dtype=torch.int32, device=q.device)
        longest = max(lengths)
        out = varlen_attention(
            q,
            k,
            v,
            cu,
            cu,
            longest,
            longest,
            causal=True,
            softmax_scale=self.softmax_scale,
            backend=self.attention_backend(q),
        )
        return cast(torch.Tensor, out)
