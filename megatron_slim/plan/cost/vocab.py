"""Where the embedding and the output layer (final norm, logits, cross entropy) run, and what they cost.

Default placement (Megatron's): the embedding on stage 0, the output layer and loss on the last
stage, each whole.

``schedule.vocab_parallel`` (the paper's vocabulary in pipeline parallelism): both are spread over
the ``pp`` pipeline ranks. Each rank holds ``1/pp`` of the embedding and output-layer weights (the
vocabulary is sharded over TP x PP; the final norm is replicated), and for every slice
computes ``1/pp`` of the embedding lookups and of the logits and cross entropy. The work is
charged to the rank's first chunk (embedding) and last chunk (output layer) of the slice; the
collectives over the PP group are charged beside it, on every rank:

* embedding: the input ids are broadcast (8 bytes per token) and the partial embeddings reduced
  onto the first stage (one hidden-state tensor of the slice);
* output layer: the last stage's final hidden states are scattered along the sequence and
  gathered back as each rank's logits need them (one hidden-state tensor of the slice), the cross
  entropy all-reduces three fp32 scalars per token (max, sum of exponentials, target logit);
* backward: the hidden-state gradient travels the reverse way (same volume), the embedding's
  gradient is broadcast back to every rank.

A collective over ``p`` ranks moving a tensor of ``B`` bytes is charged ``2 (p-1)/p B / bandwidth
+ 2 (p-1) latency`` (a ring reduce-scatter plus all-gather) on the slowest link of the PP group.
The waits for the slowest rank inside those collectives are not modelled: the paper places them
at per-rank offsets in the slice pipeline so that no rank idles on them. ``megatron-slim train``
runs a simpler exact variant. Its output layer matches this model's work split (vocabulary
shards, three fp32 scalars per token all-reduced) but sends the whole hidden states from the last
stage to every rank; its embedding splits the lookups along the sequence, point to point with
stage 0 (``runtime/pipeline/vocab_embedding.py``, ``vocab.py``). Its static memory is higher than
this model's: the owning stages keep whole weights, and the word embedding (tied: also the output
weight) is replicated whole on every rank; only untied output replicas hold just their shard.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_slim.plan.cost.layer import FP32_BYTES

if TYPE_CHECKING:
    from megatron_slim.plan.cost.model import CostModel

INPUT_ID_BYTES = 8  # int64 token ids


class VocabPlacement:
    """Embedding and output-layer time, memory and parameters per stage and rank, for either placement."""

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        self.pp = cost.recipe.parallel.pp
        self.spread = cost.recipe.schedule.vocab_parallel and self.pp > 1
        self.last_stage = cost.num_stages - 1

    # ---- which stage carries which part -------------------------------------------------------
    def holds_embedding(self, stage: int) -> bool:
        """Stage 0 by default; with the vocabulary spread, every rank's first chunk."""
        return stage < self.pp if self.spread else stage == 0

    def holds_output(self, stage: int) -> bool:
        """The last stage by default; with the vocabulary spread, every rank's last chunk."""
        return stage >= self.cost.num_stages - self.pp if self.spread else stage == self.last_stage

    @property
    def share(self) -> float:
        """The fraction of the embedding/output work and weights one holding stage carries."""
        return 1.0 / self.pp if self.spread else 1.0

    # ---- communication ------------------------------------------------------------------------
    def collective_time(self, nbytes: float) -> float:
        """One collective of ``nbytes`` over the PP group (ring reduce-scatter + all-gather)."""
        p = self.pp
        link = self.cost.pp_link(0, p - 1)
        return 2 * (p - 1) / p * nbytes / link.bandwidth + 2 * (p - 1) * link.latency

    def _ids_bytes(self, tokens: float) -> float:
        s = self.cost.shape
        return tokens * s.micro_batch / s.cp * INPUT_ID_BYTES

    def _ce_bytes(self, tokens: float) -> float:
        s = self.cost.shape
        return 3 * tokens * s.micro_batch / s.cp * FP32_BYTES

    def embedding_comm_time(self, tokens: float) -> float:
        if not self.spread:
            return 0.0
        return self.collective_time(self._ids_bytes(tokens)) + self.collective_time(self.cost.p2p_bytes(tokens))

    def output_comm_time(self, tokens: float) -> float:
        if not self.spread:
            return 0.0
        return self.collective_time(self.cost.p2p_bytes(tokens)) + self.collective_time(self._ce_bytes(tokens))

    # ---- time ---------------------------------------------------------------------------------
    def _embedding_kernel(self, tokens: float) -> float:
        return self.cost.kernel_time(self.cost.shape.embedding_forward_work(tokens).scale(self.share), False)

    def _output_kernel(self, tokens: float) -> float:
        return self.cost.kernel_time(self.cost.shape.output_forward_work(tokens).scale(self.share), False)

    def forward_time(self, stage: int, tokens: float) -> float:
        t = 0.0
        if self.holds_embedding(stage):
            t += self._embedding_kernel(tokens) + self.embedding_comm_time(tokens)
        if self.holds_output(stage):
            t += self._output_kernel(tokens) + self.output_comm_time(tokens)
        return t

    def backward_time(self, stage: int, tokens: float) -> float:
        """Backward kernels twice the forward's; the gradients move the forward's volumes back."""
        t = 0.0
        if self.holds_embedding(stage):
            t += 2 * self._embedding_kernel(tokens) + self.embedding_comm_time(tokens)
        if self.holds_output(stage):
            t += 2 * self._output_kernel(tokens) + self.output_comm_time(tokens)
        return t

    # ---- memory -------------------------------------------------------------------------------
    def activation_bytes(self, stage: int, tokens: float) -> float:
        """The output layer's saved inputs and fp32 softmax: a sequence share of them on each rank."""
        if not self.holds_output(stage):
            return 0.0
        return self.cost.shape.output_activation_bytes(tokens) * self.share

    def rank_params(self, rank: int) -> float:
        s = self.cost.shape
        if self.spread:
            return (s.embedding_params() + s.output_params() - s.hidden) / self.pp + s.hidden
        params = s.embedding_params() if rank == 0 else 0.0
        return params + (s.output_params() if rank == self.pp - 1 else 0.0)
