"""The cost model: time and memory of every schedule action of a recipe on a hardware profile.

Pipeline stage ``s`` (of ``pp * vpp``) holds ``num_layers / (pp * vpp)`` decoder layers; stage 0
also holds the embedding, the last stage the final norm, output layer and loss (or, with
``schedule.vocab_parallel``, every pipeline rank a share of both: ``plan/cost/vocab.py``). A slice of
``tokens`` tokens starting at ``prefix`` is what every per-action query takes.

GPU placement follows Megatron's rank order (tp fastest, then cp, dp, pp): two GPUs share a node
when their global indices agree after integer division by ``gpus_per_node``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_slim.plan.cost.activations import ChunkActivations
from megatron_slim.plan.cost.calibration import Calibration
from megatron_slim.plan.cost.layer import FP32_BYTES, LayerShape, OpWork
from megatron_slim.plan.cost.vocab import VocabPlacement
from megatron_slim.plan.hardware import HardwareProfile
from megatron_slim.plan.recipe import Recipe

_LAYER_TIMES: dict[tuple[object, ...], float] = {}
_LAYER_KEYS: dict[tuple[object, ...], int] = {}  # what a layer's time depends on -> a small id, hashed once
_LAYER_TIMES_KEPT = 1_000_000


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s
    latency: float  # s
    intra_node: bool

    def transfer_time(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth


class CostModel:
    def __init__(
        self, recipe: Recipe, hardware: Optional[HardwareProfile] = None, calibration: Optional[Calibration] = None
    ) -> None:
        self.recipe = recipe
        self.hw = hardware or recipe.hardware_profile
        self.calibration = calibration
        p = recipe.parallel
        self.element_bytes = 2 if recipe.train.precision == "bf16" else 4
        self.shape = LayerShape.from_configs(
            recipe.model, p, recipe.train.micro_batch_size, self.element_bytes, self.hw.layer_impl
        )
        self.num_stages = p.pp * p.vpp
        self.layers_per_stage = recipe.model.num_layers // self.num_stages
        self.recompute = recipe.train.recompute_plan
        # Everything a decoder layer's time depends on: the autotuner prices tens of thousands of
        # recipes that differ only in what does not enter it (recompute, slices, slice policy, pp), so
        # the times are shared between cost models (a calibration is a frozen value: part of the key).
        self._layer_key = _LAYER_KEYS.setdefault(
            (
                self.shape,
                self.hw,
                p,
                recipe.schedule.kind,
                recipe.train.micro_batch_size,
                self.element_bytes,
                calibration,
            ),
            len(_LAYER_KEYS),
        )
        sliced = recipe.schedule.kind == "slimpipe" and recipe.schedule.num_slices > 1
        self.chunk = ChunkActivations(self.shape, self.recompute, self.layers_per_stage, kv_cached=sliced)
        self.vocab = VocabPlacement(self)

    # ---- kernel time --------------------------------------------------------------------------
    def _rate(self, op: str, work: float) -> float:
        if self.calibration is not None:
            measured = self.calibration.rate(op, work)
            if measured is not None:
                return measured
        eff = self.hw.efficiency
        if op == "memory_bound":
            return self.hw.hbm_bandwidth * eff.memory_bound
        factor = {
            "gemm": eff.gemm,
            "attention_forward": eff.attention_forward,
            "attention_backward": eff.attention_backward,
        }[op]
        return self.hw.peak_bf16_flops * factor

    def kernel_time(self, work: OpWork, backward: bool) -> float:
        attn_op = "attention_backward" if backward else "attention_forward"
        t = 0.0
        if work.gemm_flops:
            t += work.gemm_flops / self._rate("gemm", work.gemm_flops)
        if work.attention_flops:
            t += work.attention_flops / self._rate(attn_op, work.attention_flops)
        if work.memory_bytes:
            t += work.memory_bytes / self._rate("memory_bound", work.memory_bytes)
        return t

    # ---- placement and links -----------------------------------------------------------------
    def gpu_index(self, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        p = self.recipe.parallel
        return tp + p.tp * (cp + p.cp * (dp + p.dp * pp))

    def node_of(self, gpu: int) -> int:
        return gpu // self.hw.gpus_per_node

    def link(self, gpu_a: int, gpu_b: int) -> Link:
        if self.node_of(gpu_a) == self.node_of(gpu_b):
            return Link(self.hw.nvlink_bandwidth, self.hw.nvlink_latency, True)
        # When every GPU of a node sends at once, each gets its share of the node's NICs.
        share = min(1.0, self.hw.nics_per_node / self.hw.gpus_per_node)
        return Link(self.hw.nic_bandwidth * share, self.hw.nic_latency, False)

    def pp_link(self, src_rank: int, dst_rank: int) -> Link:
        return self.link(self.gpu_index(pp=src_rank), self.gpu_index(pp=dst_rank))

    def _group_link(self, size: int, stride: int) -> Link:
        """The slowest link of a ring over ``size`` GPUs ``stride`` apart."""
        if size <= 1:
            return Link(float("inf"), 0.0, True)
        return self.link(0, stride * (size - 1))

    # ---- per-action time ----------------------------------------------------------------------
    def _layer_comm_time(self, tokens: float, prefix: float, backward: bool) -> tuple[float, float]:
        """(time on the critical path, time that overlaps attention) of one layer's communication.

        TP collectives are on the critical path. Context parallelism depends on the schedule:
        1F1B/interleaved use Megatron's ring (each step passes this rank's K/V block on, dK/dV back
        in backward; overlaps attention): ``cp.engine=megatron``, whatever the recipe's engine
        (``simulate --cp-engine`` prices megatron-slim's engines per pack). SlimPipe uses query-out
        attention over the K/V-cached slices (``runtime/pipeline/cp_slice_attention.py``): forward
        all-gathers the slice's Q and all-to-alls fp32 partial outputs and log-sum-exps; backward
        all-gathers q, dout, out and lse and reduce-scatters fp32 dQ. Those are blocking
        collectives, independent of the prefix.
        """
        p = self.recipe.parallel
        serial = 0.0
        if p.tp > 1:
            link = self._group_link(p.tp, 1)
            per = self.shape.tp_collective_bytes(tokens) * (p.tp - 1) / p.tp
            serial += 4 * (per / link.bandwidth + (p.tp - 1) * link.latency)
        overlapped = 0.0
        if p.cp > 1:
            link = self._group_link(p.cp, p.tp)
            if self.recipe.schedule.kind == "slimpipe":
                heads = self.shape.heads / p.tp
                rows = tokens * self.recipe.train.micro_batch_size  # the whole slice's queries
                q = rows * self.shape.hidden / p.tp * self.element_bytes
                partials = rows * (self.shape.hidden / p.tp + heads) * FP32_BYTES
                moved = (3 * q + partials) if backward else (q + partials)  # bwd: q, dout, out (+lse), dQ fp32
                serial += moved * (p.cp - 1) / p.cp / link.bandwidth + 2 * (p.cp - 1) * link.latency
            else:
                kv = self.shape.kv_bytes(tokens + prefix)
                overlapped = (p.cp - 1) * (kv * (2 if backward else 1) / link.bandwidth + link.latency)
        return serial, overlapped

    def _layer_time(self, tokens: float, prefix: float, backward: bool) -> float:
        key = (self._layer_key, tokens, prefix, backward)
        t = _LAYER_TIMES.get(key)
        if t is None:
            if len(_LAYER_TIMES) > _LAYER_TIMES_KEPT:
                _LAYER_TIMES.clear()
            t = _LAYER_TIMES[key] = self._price_layer(tokens, prefix, backward)
        return t

    def _price_layer(self, tokens: float, prefix: float, backward: bool) -> float:
        s = self.shape
        work = s.backward_work(tokens, prefix) if backward else s.forward_work(tokens, prefix)
        attn = OpWork(0.0, work.attention_flops, 0.0)
        rest = OpWork(work.gemm_flops, 0.0, work.memory_bytes)
        serial, overlapped = self._layer_comm_time(tokens, prefix, backward)
        return self.kernel_time(rest, backward) + max(self.kernel_time(attn, backward), overlapped) + serial

    def decoder_layer_time(self, tokens: float, prefix: float, backward: bool) -> float:
        """One decoder layer's forward or backward of a slice, communication included (no
        recompute, no offload): what a per-layer view such as DynMo's repartitioner scales."""
        return self._layer_time(tokens, prefix, backward)

    def _layers_time(self, tokens: float, prefix: float, backward: bool) -> float:
        return self._layer_time(tokens, prefix, backward) * self.layers_per_stage

    def _offload_exposed_time(self, tokens: float, compute: float) -> float:
        """A slice's offloaded share crosses PCIe once each way (to host after forward, back before
        backward) on a copy stream beside the compute: only what outlasts the action shows."""
        if not self.recompute.offload_ratio:
            return 0.0
        copy = self.chunk.offloaded_bytes(tokens) / self.hw.pcie_bandwidth
        return max(0.0, copy - compute)

    def forward_time(self, stage: int, tokens: float, prefix: float) -> float:
        t = self._layers_time(tokens, prefix, backward=False) + self.vocab.forward_time(stage, tokens)
        return t + self._offload_exposed_time(tokens, t)

    def recompute_time(self, tokens: float, prefix: float) -> float:
        """Forward work a stage's backward repeats: whole recomputed layers (communication
        included) under full, the checkpointed modules' kernels under selective."""
        recomputed = self.recompute.recomputed_layers(self.layers_per_stage)
        t = self._layer_time(tokens, prefix, backward=False) * recomputed
        return t + self.kernel_time(self.chunk.selective_work(tokens, prefix), False)

    def backward_time(self, stage: int, tokens: float, prefix: float) -> float:
        t = self._layers_time(tokens, prefix, backward=True) + self.vocab.backward_time(stage, tokens)
        t += self.recompute_time(tokens, prefix)
        return t + self._offload_exposed_time(tokens, t)

    def weight_grad_time(self, stage: int, tokens: float, prefix: float) -> float:
        """The ``W`` part of a split backward: weight-gradient GEMMs only."""
        s = self.shape
        gemm = s.backward_work(tokens, prefix).gemm_flops * s.weight_grad_fraction()
        return self.kernel_time(OpWork(gemm, 0.0, 0.0), True) * self.layers_per_stage

    # ---- memory -------------------------------------------------------------------------------
    def activation_bytes(self, stage: int, tokens: float) -> float:
        """What a slice keeps on the GPU from its forward to its backward (K/V aside)."""
        return self.chunk.resident_bytes(tokens) + self.vocab.activation_bytes(stage, tokens)

    def backward_transient_bytes(self, stage: int, tokens: float) -> float:
        """Held only while a slice's backward runs: recompute working set and prefetched offload."""
        return self.chunk.backward_transient_bytes(tokens)

    def kv_bytes(self, stage: int, tokens: float) -> float:
        """K/V this slice leaves in the cache (a fully recomputed layer's is rebuilt, unless sliced)."""
        return self.shape.kv_bytes(tokens) * self.chunk.kv_layers()

    def kv_grad_bytes(self, stage: int, tokens: float) -> float:
        return self.shape.kv_grad_bytes(tokens) * self.layers_per_stage

    def rank_params(self, rank: int) -> float:
        p = self.recipe.parallel
        return self.shape.layer_params() * self.layers_per_stage * p.vpp + self.vocab.rank_params(rank)

    def static_bytes(self, rank: int) -> float:
        """Weights, gradients and Adam state on one GPU of pipeline rank ``rank``.

        bf16: bf16 weights + fp32 main grads + fp32 master/exp_avg/exp_avg_sq; fp32: weights,
        grads, exp_avg, exp_avg_sq. The distributed optimizer shards optimizer state over dp*cp.
        """
        t, p = self.recipe.train, self.recipe.parallel
        params = self.rank_params(rank)
        shards = p.dp * p.cp if t.distributed_optimizer else 1
        if t.precision == "bf16":
            return params * (2 + FP32_BYTES + 3 * FP32_BYTES / shards)
        return params * (FP32_BYTES + FP32_BYTES + 2 * FP32_BYTES / shards)

    def p2p_bytes(self, tokens: float) -> float:
        return self.shape.p2p_bytes(tokens)

    # ---- whole-iteration terms ------------------------------------------------------------------
    def grad_sync_time(self, rank: int) -> float:
        """Reduce-scatter + all-gather (distributed optimizer) or all-reduce of fp32 grads over dp*cp."""
        p = self.recipe.parallel
        n = p.dp * p.cp
        if n == 1:
            return 0.0
        link = self.link(self.gpu_index(pp=rank), self.gpu_index(dp=p.dp - 1, cp=p.cp - 1, pp=rank))
        nbytes = self.rank_params(rank) * FP32_BYTES
        return 2 * (n - 1) / n * nbytes / link.bandwidth + 2 * (n - 1) * link.latency

    def optimizer_time(self, rank: int) -> float:
        p, t = self.recipe.parallel, self.recipe.train
        shards = p.dp * p.cp if t.distributed_optimizer else 1
        # Adam reads and writes param, grad, master, exp_avg, exp_avg_sq (~36 bytes per param). The
        # rate is looked up at the real byte count: a calibration's small-kernel points are launch-bound.
        nbytes = self.rank_params(rank) / shards * 36
        return nbytes / self._rate("memory_bound", nbytes) if nbytes else 0.0

    def model_flops(self, tokens: float) -> float:
        """Model FLOPs (forward + 2x backward, no recompute) of one microbatch on one GPU's share
        of every stage, summed over stages: the MFU numerator per pipeline of tp*cp GPUs."""
        s = self.shape
        fwd = s.forward_work(tokens, 0.0)
        per_layer = fwd.gemm_flops + fwd.attention_flops
        out = s.output_forward_work(tokens).gemm_flops
        return 3 * (per_layer * self.recipe.model.num_layers + out)

    # ---- slicing coefficients -------------------------------------------------------------------
    def slice_cost_coefficients(self, tokens: float, seq_length: float) -> tuple[float, float]:
        """(seconds per token, seconds per causal query-key pair) of forward+backward on a middle
        stage, fitted to the same time functions the simulator uses at a slice of ``tokens`` placed
        first and last in the sequence: what the balanced slice policy equalises."""
        stage = min(1, self.num_stages - 1)

        def fwd_bwd(prefix: float) -> float:
            return self.forward_time(stage, tokens, prefix) + self.backward_time(stage, tokens, prefix)

        last = seq_length - tokens
        per_pair = (fwd_bwd(last) - fwd_bwd(0.0)) / (tokens * last) if last > 0 else 0.0
        per_token = (fwd_bwd(0.0) - per_pair * tokens * (tokens + 1) / 2) / tokens
        return max(per_token, 0.0), max(per_pair, 0.0)
