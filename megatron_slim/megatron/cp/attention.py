"""Zeppelin's context parallelism inside megatron-core model chunks.

Three pieces, wired after the model is built (like ``slimpipe/slicing.py``), so the layer spec stays static
while the plan changes every microbatch:

* ``CPContext`` -- one per model replica and CP group: the attention engine, the current
  ``CPPlan`` / ``RoutingPlan`` / ``RemapPlan`` and this rank's position ids. ``set_plan`` is
  collective over the CP group (the ranks compare the plan's hash and fail loudly on a mismatch);
  call it on every CP rank before each microbatch's forward.
* ``CPCoreAttention`` -- the core attention for the layer spec: megatron hands it this rank's
  q/k/v (RoPE already applied) in the plan's attention-layout order; it runs the engine.
* ``CPRotary`` -- wraps the chunk's rotary embedding so each token is rotated by its true
  position inside its own sequence (``RankLayout.position_ids``), not by its row.

``attach_context_parallel(chunk, context)`` installs the context in every ``CPCoreAttention`` and
``RemapTransformerLayer`` of a chunk and wraps its rotary embedding. ``cp_layer_spec`` /
``cp_layer_classes`` give the spec pieces (``--cp-engine zeppelin``, ``--cp-remap``).
"""

from __future__ import annotations

from typing import Any, Optional, TypedDict

import torch

from megatron_slim.megatron.cp.padding import padding_rows, split_padding
from megatron_slim.megatron.cp.remap_layer import RemapTransformerLayer
from megatron_slim.megatron.model.core_attention import SlimCoreAttention
from megatron_slim.megatron.model.rotary import rope_table
from megatron_slim.megatron.model.wrapping import RotaryWrapper, wrap_rotary
from megatron_slim.plan.cp.layout import CPPlan
from megatron_slim.plan.cp.remap import RemapPlan
from megatron_slim.plan.cp.routing import RoutingPlan
from megatron_slim.runtime.cp import CPAttentionEngine


class CPContext:
    def __init__(self, cp_group, *, device: torch.device | str = "cpu") -> None:
        """``device``: where the hash comparison runs (the CP group's backend must reach it: CPU for
        gloo, the local GPU for NCCL); ``attach_context_parallel`` sets it from the chunk."""
        self.engine = CPAttentionEngine(cp_group)
        self.device = torch.device(device)
        self.plan: Optional[CPPlan] = None
        self.routing: Optional[RoutingPlan] = None
        self.remap: Optional[RemapPlan] = None
        self.remap_back: Optional[RemapPlan] = None
        self._positions: Optional[torch.Tensor] = None
        self.padding = 0  # rows this rank runs beyond the plan's tokens (``cp.padding``)

    @property
    def comm(self):
        return self.engine.comm

    @property
    def rank(self) -> int:
        return self.engine.rank

    def set_plan(
        self, plan: CPPlan, *, routing: Optional[RoutingPlan] = None, remap: Optional[RemapPlan] = None
    ) -> str:
        """Collective: make ``plan`` (with its routing and remap plans) current on this rank."""
        if remap is not None and tuple(remap.source_tokens) != plan.tokens_per_rank():
            raise ValueError(
                f"remap plan moves from {remap.source_tokens} tokens per rank, the CP plan holds "
                f"{plan.tokens_per_rank()}: it was made for another plan"
            )
        digest = self.engine.prepare(
            plan, routing, device=self.device, extra=remap.digest() if remap is not None else "no-remap"
        )
        self.plan, self.routing, self.remap = plan, routing, remap
        self.remap_back = remap.inverse() if remap is not None else None
        self.padding = padding_rows(plan, self.rank)
        self._positions = None
        return digest

    @property
    def planned_tokens(self) -> int:
        """Tokens the current plan gives this rank (its model input holds ``padding`` rows more)."""
        return self._current_plan().ranks[self.rank].num_tokens

    def _current_plan(self) -> CPPlan:
        if self.plan is None:
            raise RuntimeError("CPContext has no plan: call set_plan(...) on every CP rank first")
        return self.plan

    def position_ids(self) -> torch.Tensor:
        """Positions of this rank's tokens inside their sequences, in attention-layout order."""
        plan = self._current_plan()
        if self._positions is None:
            self._positions = torch.tensor(
                plan.ranks[self.rank].position_ids() + [0] * self.padding, dtype=torch.long, device=self.device
            )
        return self._positions


class CPCoreAttention(SlimCoreAttention):
    """Core attention running the context-parallel engine on the current plan of ``context``."""

    context: Optional[CPContext] = None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = self.context
        if ctx is None or ctx.plan is None:
            cp = self.cp_group
            if cp is not None and cp.size() > 1:
                raise RuntimeError(
                    f"layer {self.layer_number}: context-parallel attention has no plan; call "
                    "attach_context_parallel(chunk, context) and context.set_plan(...)"
                )
            return super().attend(q, k, v)
        if q.shape[0] != 1:
            raise ValueError(
                f"layer {self.layer_number}: a CP plan describes one pack per microbatch; got "
                f"micro-batch size {q.shape[0]} (allowed: 1; pack sequences instead)"
            )
        (q, padding), (k, _), (v, _) = (split_padding(x[0], ctx.planned_tokens) for x in (q, k, v))
        out = ctx.engine(q, k, v, softmax_scale=self.softmax_scale, backend=self.attention_backend(q))
        if padding.shape[0]:  # a padding row attends to nothing (cp_padding)
            out = torch.cat([out, out.new_zeros(padding.shape[0], *out.shape[1:])])
        return out.unsqueeze(0)

    def attend_documents(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: tuple[int, ...]
    ) -> torch.Tensor:
        if self.context is not None and self.context.plan is not None:
            raise ValueError(
                "packed_seq_params (THD) with a context-parallel plan: allowed: packed_seq_params=None (the "
                "plan already places each sequence)"
            )
        return super().attend_documents(q, k, v, lengths)


class CPRotary(RotaryWrapper):
    """The chunk's rotary embedding, evaluated at the current plan's position ids of this rank."""

    def forward(self, max_seq_len: int, offset: int = 0, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.context.plan is None:
            return self.inner(max_seq_len, offset, *args, **kwargs)
        if offset:
            raise ValueError(
                f"rotary offset={offset}: allowed 0 under context parallelism (positions come from the plan)"
            )
        return rope_table(self.inner, self.context.position_ids())


def attach_context_parallel(chunk: torch.nn.Module, context: CPContext) -> int:
    """Point ``chunk``'s CP attentions and remap layers at ``context``; wrap its rotary embedding.
    Returns the number of ``CPCoreAttention`` found (0: the spec lacks it, refuse to run)."""
    params = next(iter(chunk.parameters()), None)
    if params is not None and context.device.type != params.device.type:
        context.device = params.device
    found = 0
    for module in chunk.modules():
        if isinstance(module, CPCoreAttention):
            module.context = context
            found += 1
        elif isinstance(module, RemapTransformerLayer):
            module.cp_context = context
    wrap_rotary(chunk, CPRotary, context)
    return found


class LayerClasses(TypedDict):
    """Keyword arguments of ``model.gpt.layer_spec`` / ``build_chunk``."""

    core_attention: type
    transformer_layer: Optional[type]


def cp_layer_classes(*, remap: bool) -> LayerClasses:
    """Keyword arguments for ``model.gpt.build_chunk`` / ``model.gpt.layer_spec``: the CP core attention and,
    with ``remap`` (``--cp-remap`` / recipe ``cp.remap``), the remapping transformer layer."""
    return {"core_attention": CPCoreAttention, "transformer_layer": RemapTransformerLayer if remap else None}


def cp_layer_spec(*, remap: bool, layer_offset: int = 0):
    """A Llama layer spec (``model.gpt.layer_spec``) with Zeppelin's attention and optional remap layer."""
    from megatron_slim.megatron.model.gpt import layer_spec

    return layer_spec(**cp_layer_classes(remap=remap), layer_offset=layer_offset)
