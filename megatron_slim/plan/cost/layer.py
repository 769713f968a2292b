"""Per-GPU work and memory of one Llama-style decoder layer and of the embedding/output layers.

Everything is per GPU: tensor parallelism (``tp``) shards heads and the MLP, sequence parallelism
shards norm/residual activations over ``tp`` as well, and context parallelism (``cp``) shards the
tokens (zigzag, so causal attention work is balanced across CP ranks).

Attention cost depends on the prefix: a slice of ``s`` tokens whose first token sits at position
``P`` under a causal mask scores ``s * P + s * (s + 1) / 2`` query-key pairs.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_slim.plan.recipe import ModelConfig, ParallelConfig

FP32_BYTES = 4


def causal_pairs(tokens: float, prefix: float) -> float:
    """Query-key pairs a slice of ``tokens`` starting at position ``prefix`` scores causally."""
    return tokens * prefix + tokens * (tokens + 1) / 2


@dataclass(frozen=True)
class OpWork:
    """Work of one pass split by kernel class: FLOPs on tensor cores, bytes through HBM."""

    gemm_flops: float = 0.0
    attention_flops: float = 0.0
    memory_bytes: float = 0.0

    def __add__(self, other: "OpWork") -> "OpWork":
        return OpWork(
            self.gemm_flops + other.gemm_flops,
            self.attention_flops + other.attention_flops,
            self.memory_bytes + other.memory_bytes,
        )

    def scale(self, factor: float) -> "OpWork":
        return OpWork(self.gemm_flops * factor, self.attention_flops * factor, self.memory_bytes * factor)


@dataclass(frozen=True)
class LayerShape:
    """What the formulas need, per GPU."""

    hidden: int
    ffn: int
    heads: int
    groups: int
    head_dim: int
    vocab: int
    tp: int
    cp: int
    sequence_parallel: bool
    micro_batch: int
    element_bytes: int  # activations and weights (2 for bf16, 4 for fp32)
    layer_impl: str = "te"  # "te" (fused GPU kernels) or "local" (megatron-core local spec)

    @classmethod
    def from_configs(
        cls, model: ModelConfig, parallel: ParallelConfig, micro_batch: int, element_bytes: int, layer_impl: str = "te"
    ) -> "LayerShape":
        return cls(
            model.hidden_size,
            model.ffn_hidden_size,
            model.num_attention_heads,
            model.num_query_groups,
            model.head_dim,
            model.vocab_size,
            parallel.tp,
            parallel.cp,
            parallel.sequence_parallel,
            micro_batch,
            element_bytes,
            layer_impl,
        )

    @property
    def sp(self) -> int:
        """Shard factor of activations outside the TP regions (norms, residual stream)."""
        return self.tp if self.sequence_parallel else 1

    @property
    def kv_width(self) -> int:
        return self.groups * self.head_dim

    # ---- parameters -------------------------------------------------------------------------
    def layer_params(self) -> float:
        """Parameters of one decoder layer on one TP rank (norm weights are replicated)."""
        h, f, kv = self.hidden, self.ffn, self.kv_width
        return (h * (h + 2 * kv) + h * h + 3 * h * f) / self.tp + 2 * h

    def embedding_params(self) -> float:
        return self.vocab * self.hidden / self.tp

    def output_params(self) -> float:
        return self.vocab * self.hidden / self.tp + self.hidden  # output layer + final norm

    # ---- forward work -----------------------------------------------------------------------
    def _local(self, tokens: float) -> float:
        return tokens * self.micro_batch / self.cp

    def forward_work(self, tokens: float, prefix: float) -> OpWork:
        h, f, kv, tp, e = self.hidden, self.ffn, self.kv_width, self.tp, self.element_bytes
        n = self._local(tokens)
        gemm = 2 * n * (h * (h + 2 * kv) + h * h + 3 * h * f) / tp
        # QK^T and PV, each 2 FLOPs per pair per head dim, over this GPU's heads and CP share.
        attention = 4 * self.micro_batch * (self.heads / tp) * self.head_dim * causal_pairs(tokens, prefix) / self.cp
        # norms (read+write), residual adds (2 reads + write), RoPE on q and k, SwiGLU (3 tensors).
        memory = n * e * (2 * 2 * h / self.sp + 2 * 3 * h / self.sp + 2 * (h + kv) / tp + 3 * f / tp)
        return OpWork(gemm, attention, memory)

    def backward_work(self, tokens: float, prefix: float) -> OpWork:
        """Backward: GEMMs twice the forward (input and weight grads); flash attention's backward
        recomputes the scores, five matmuls against the forward's two; elementwise ops twice."""
        fwd = self.forward_work(tokens, prefix)
        return OpWork(2 * fwd.gemm_flops, 2.5 * fwd.attention_flops, 2 * fwd.memory_bytes)

    def weight_grad_fraction(self) -> float:
        """Share of backward GEMM FLOPs that is weight gradient (the ``W`` of a split backward)."""
        return 0.5

    def output_forward_work(self, tokens: float) -> OpWork:
        n = self._local(tokens)
        v = self.vocab / self.tp
        return OpWork(2 * n * self.hidden * v, 0.0, n * v * FP32_BYTES * 3 + n * self.hidden * self.element_bytes * 2)

    def embedding_forward_work(self, tokens: float) -> OpWork:
        n = self._local(tokens)
        return OpWork(0.0, 0.0, 2 * n * self.hidden * self.element_bytes / self.sp)

    # ---- saved activations ------------------------------------------------------------------
    def activation_bytes(self, tokens: float) -> float:
        """Bytes one layer saves for backward without recomputation, excluding K and V (counted as
        K/V cache); ``plan.cost.activations`` prices recomputation and offloading from it.

        ``te``: each norm+linear saves its input and normalised output (2h), attention saves q
        and its output (2h), fused SwiGLU saves fc1's output (2f) and fc2 its input (f).
        ``local`` (measured on megatron-core 0.16.1's local spec): each torch RMSNorm keeps its
        input, the normalised input and the weighted output the next linear saves (3h), the
        unfused GLU keeps fc1's output (2f), silu's output, ``x_linear + offset`` and the product
        (3f), RoPE keeps fp32 cos/sin tables for q and k, and each norm its rsqrt.
        """
        h, f, tp, e = self.hidden, self.ffn, self.tp, self.element_bytes
        n = self._local(tokens)
        lse = n * (self.heads / tp) * FP32_BYTES
        if self.layer_impl == "local":
            rope_tables = 4 * self.head_dim * FP32_BYTES
            return n * e * (6 * h / self.sp + 2 * h / tp + 5 * f / tp + 2) + n * rope_tables + lse
        return n * e * (4 * h / self.sp + 2 * h / tp + 3 * f / tp) + lse

    def checkpoint_input_bytes(self, tokens: float) -> float:
        """A checkpointed layer's (or group's) input: the residual stream, sharded by SP."""
        return self._local(tokens) * self.hidden * self.element_bytes / self.sp

    def selective_savings_bytes(self, tokens: float, modules: tuple[str, ...]) -> float:
        """Bytes one layer no longer saves when Megatron's selective ``--recompute-modules`` are
        checkpointed (per module, from the breakdown in ``activation_bytes``).

        ``core_attn``: Korthikanti et al. (arXiv 2205.05198, Table 2) count 5·a·s²·b bytes of
        scores, softmax and dropout mask per layer that selective recompute drops. Every attention
        kernel here is flash-style and saves no s² tensor: the checkpoint keeps its inputs q, k, v
        and its output is the projection's saved input, so what goes is the fp32 log-sum-exp
        (Megatron's own warning: fused attention gains little from core_attn recompute).
        ``mlp``: the checkpoint keeps the MLP's input; ``te`` drops the fused norm's normalised
        output (h) and SwiGLU's 3f, ``local`` (separate norm module) the GLU's 5f.
        ``layernorm``: only separate norm modules (``local``) are recomputed, each keeping its
        input and dropping the normalised and weighted outputs (2h); ``te`` fuses them into the
        linears. The MoE and MLA modules do not exist in a dense Llama layer: they save nothing.
        """
        h, f, tp, e = self.hidden, self.ffn, self.tp, self.element_bytes
        n = self._local(tokens)
        local = self.layer_impl == "local"
        saved = 0.0
        if "core_attn" in modules:
            saved += n * (self.heads / tp) * FP32_BYTES
        if "mlp" in modules:
            saved += n * e * (5 * f / tp if local else h / self.sp + 3 * f / tp)
        if "layernorm" in modules and local:
            saved += n * e * 2 * 2 * h / self.sp
        return saved

    def selective_forward_work(self, tokens: float, prefix: float, modules: tuple[str, ...]) -> OpWork:
        """Forward work one layer repeats in backward for its selectively recomputed modules
        (communication they repeat under TP is not counted)."""
        h, f, tp, e = self.hidden, self.ffn, self.tp, self.element_bytes
        n = self._local(tokens)
        work = OpWork()
        if "core_attn" in modules:
            work += OpWork(0.0, self.forward_work(tokens, prefix).attention_flops, 0.0)
        if "mlp" in modules:
            work += OpWork(2 * n * 3 * h * f / tp, 0.0, n * e * (2 * h / self.sp + 3 * f / tp))
        if "layernorm" in modules and self.layer_impl == "local":
            work += OpWork(0.0, 0.0, n * e * 2 * 2 * h / self.sp)
        return work

    def kv_bytes(self, tokens: float) -> float:
        """K and V of ``tokens`` for one layer: the cache later slices attend to."""
        return 2 * self._local(tokens) * self.kv_width / self.tp * self.element_bytes

    def kv_grad_bytes(self, tokens: float) -> float:
        """dK/dV accumulation buffer for ``tokens`` of one layer (fp32 for exact accumulation)."""
        return 2 * self._local(tokens) * self.kv_width / self.tp * FP32_BYTES

    def output_activation_bytes(self, tokens: float) -> float:
        """Final norm and output layer inputs plus the fp32 softmax the cross entropy keeps."""
        n = self._local(tokens)
        return n * self.hidden * self.element_bytes * 2 / self.sp + n * self.vocab / self.tp * FP32_BYTES

    def p2p_bytes(self, tokens: float) -> float:
        """Hidden states one GPU sends to the next pipeline stage for a slice of ``tokens``."""
        return self._local(tokens) * self.hidden * self.element_bytes / self.sp

    def tp_collective_bytes(self, tokens: float) -> float:
        """Bytes each TP collective of a layer moves per GPU (4 per layer per pass with SP:
        2 all-gathers + 2 reduce-scatters; equivalently 2 all-reduces without SP)."""
        return self._local(tokens) * self.hidden * self.element_bytes
